"""The XLA path, and what every lookup path shares.

Plain ``jnp`` / ``lax`` code that runs on any platform: the lookups every
kernel falls back to and is checked against (``lookup``), the feature slots
of a stacked buffer (``slots``), bounds checks (``bounds``), the sparse
backward's gradient sources (``backward``) and the quantized row format
(``quantize``). The kernel backends (``jaxrec.pallas``, ``jaxrec.cpu``) and
the dispatching API (``jaxrec.ops``) build on it; it imports neither.
"""
