"""Everything Ray: the driver (launcher), the worker entry point, Ray Train controller policies,
membership, spot-notice watchers. Private Ray APIs are imported in ray_internals.py only."""
