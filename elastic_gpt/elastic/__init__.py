"""Everything Ray: the driver (launcher), the worker entry point, Ray Train controller policies,
membership, spot-notice watchers. The one package that may import private Ray APIs."""
