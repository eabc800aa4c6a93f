"""Helpers shared by tests/ and bench/: free ports, real servers on loopback (S3 via moto, MLflow),
multi-node Ray clusters on one machine, gloo process groups. Needs the `dev` extras; nothing in the
trainer imports this package."""
