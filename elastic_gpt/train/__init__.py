"""One worker's training: the Trainer (step loop, loss scaling, metrics), the optimizer, the LR
schedule and the goodput ledger. Runs under any torch process group; imports no Ray."""
