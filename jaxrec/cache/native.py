"""The C++ passes of the cache (``jaxrec.cpu._kernels``), or None without the extension."""

try:
    from ..cpu import _kernels as kernels
except ImportError:  # not built: numpy does the same work
    kernels = None

AVAILABLE = kernels is not None and hasattr(kernels, "cache_rows")
