"""`ray job submit ... -- python jobs/prepare_data.py --input s3://bucket/raw/*.jsonl.zst
--output s3://bucket/tokens/run1 --tokenizer gpt2 --seq-len 1024`: the tokenization Ray Data job
(data_pipelines/tokenize_job.py) with the arguments and errors of `elastic-gpt prepare-data`;
`python -m data_pipelines prepare ...` runs the same job."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic_gpt.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["prepare-data", *sys.argv[1:]]))
