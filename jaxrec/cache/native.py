"""The C++ passes of the cache (``jaxrec.cpu.host_functions``), or None without the
extension (numpy then does the same work)."""

from ..cpu import host_functions

kernels = host_functions()
AVAILABLE = kernels is not None
