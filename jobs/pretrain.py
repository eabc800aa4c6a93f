"""`ray job submit ... -- python jobs/pretrain.py --config jobs/configs/mini.yaml [key=value ...]`

The job's driver: runs on the head node, connects to the cluster it was submitted to (Ray sets
RAY_ADDRESS for a job) and trains, resuming from the newest committed checkpoint if there is one,
so `ray job stop` followed by a resubmit of the same command continues the same run.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic_gpt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
