"""The validation wing: the planner's cost model checked against published training runs.

Not part of the product (not installed, and nothing in elastic_gpt/ imports it): it holds the
published runs, the software of 2021 some of them ran (Megatron-LM, DeepSpeed's ZeRO-3) as the
cost model's `Software` (elastic_gpt/cost_model/software.py), the checks, and dated reports of
what they print. README.md says what it is for; `python -m validation.published_runs` prints
the checks.
"""
