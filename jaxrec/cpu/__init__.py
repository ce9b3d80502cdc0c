"""jaxrec's C++ CPU kernels (``implementation="cpu"``), registered through the XLA FFI.

The kernels are an optional extension (``jaxrec/cpu/_kernels``, built from
``csrc/`` by ``pip install``). They are loaded and registered with JAX the
first time one may run (after the backend has started). If the extension is
missing or fails to load, :func:`load` says why; the dispatcher then runs the
XLA path and warns once. ``jaxrec.ops.backends`` lists which wrapper serves
which op; this package imports nothing of ``jaxrec.ops``.

Threads: ``JAXREC_CPU_THREADS`` (default: every core the process may use).
"""

from .kernels import (
    backward_update_cpu as backward_update_cpu,
)
from .kernels import (
    embedding_bag_cpu as embedding_bag_cpu,
)
from .kernels import (
    grouped_pooled_lookup_cpu as grouped_pooled_lookup_cpu,
)
from .kernels import (
    kjt_backward_update_cpu as kjt_backward_update_cpu,
)
from .loader import (
    available as available,
)
from .loader import (
    build_info as build_info,
)
from .loader import (
    host_functions as host_functions,
)
from .loader import (
    load as load,
)
from .loader import (
    unavailable_reason as unavailable_reason,
)
from .roofline import (
    gather_pool_rows as gather_pool_rows,
)
from .roofline import (
    gather_rows as gather_rows,
)
from .roofline import (
    read_bandwidth as read_bandwidth,
)
