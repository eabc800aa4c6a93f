"""MLflow tracking, one module per concern: `redaction` (no secret leaves the process), `client`
(a bounded connection to the store), `runs` (one run across restarts, C5 one MLflow run), `events`
(the run's events.jsonl), `metric_logger` (step and system metrics from a background thread) and
`publish` (the end of a submission). Nothing here imports the model, inference or checkpoint code.
"""
