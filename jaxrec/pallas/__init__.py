"""Pallas GPU kernels: table-batched pooled lookup, sequence lookup, fused sparse update.

Backend choice: **Triton lowering** (``jax.experimental.pallas.triton``).
The kernels are gathers of whole rows at data-dependent addresses; Triton
expresses them directly (a masked load from a tensor of row pointers, any
SM from sm_80 on) and lowers identically on CI's JAX 0.10.2 and the GPU
machines' JAX 0.11.x, where it is deprecated but still supported. Mosaic GPU
(the long-term backend) needs sm_90+, schedules warpgroups and moves data by
TMA/async copies of static-shaped tiles; a per-row gather there means one
copy per row (or Blackwell's TMA gather), a larger rewrite we would tune
only with a GPU in hand. Both lower on this CPU-only machine
(``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``), so moving
later is a per-kernel change behind the same wrappers and references. The
pooled lookup has a Mosaic GPU version, ``jaxrec.pallas.mosaic_pooled`` (not
imported here: it would add Mosaic GPU to ``import jaxrec``), tested in Pallas's
Mosaic GPU interpreter and not yet run on a GPU.

Without Triton: JAX will remove the backend. ``jaxrec.pallas.triton_backend``
is the one import of it, guarded, so ``import jaxrec`` works on any JAX. When
the module does not import, or a Triton ``pallas_call`` no longer lowers for
CUDA (probed once, deviceless, the first time a kernel would be staged),
:func:`available` is False and :func:`unavailable_reason` says why; the
``jaxrec.ops`` entry points then run XLA wherever a kernel would have run
(``implementation=None`` on GPUs, ``"pallas"`` anywhere) and warn once per
process with :class:`PallasBackendWarning`. A direct call of a kernel below
raises :class:`TritonUnavailableError` (a ``NotImplementedError``) naming
the cause.

Triton needs power-of-two block shapes: ``D`` (any multiple of 4) is covered
by ``next_pow2(D)`` lanes with the surplus masked, and the optimizers' row
means take ``dim=D`` (see ``jaxrec.optim.base``).

Every kernel sits beside a pure-jnp ``*_reference`` and a jitted wrapper
(validation, static ``tiling``, ``interpret`` flag). ``jaxrec.ops`` dispatches
to them (``implementation=None`` picks them on GPU) through the adapters of
``jaxrec.pallas.adapters``, listed per op in ``jaxrec.ops.backends``; this
package imports nothing of ``jaxrec.ops``.
"""

from .pooled import pooled_lookup as pooled_lookup
from .pooled import pooled_lookup_reference as pooled_lookup_reference
from .pooled import ranges_from_segments as ranges_from_segments
from .sequence import sequence_lookup as sequence_lookup
from .sequence import sequence_lookup_reference as sequence_lookup_reference
from .tiling import Tiling as Tiling
from .triton_backend import PallasBackendWarning as PallasBackendWarning
from .triton_backend import TritonUnavailableError as TritonUnavailableError
from .triton_backend import available as available
from .triton_backend import unavailable_reason as unavailable_reason
from .update import fused_backward_update as fused_backward_update
from .update import fused_backward_update_reference as fused_backward_update_reference
from .update import sparse_update as sparse_update
from .update import sparse_update_reference as sparse_update_reference
