"""Recommendation models (TorchRec's ``torchrec.models`` and its retrieval example).

DLRM's arches are exported here; SimpleDeepFMNN's arches of the same names live
in ``jaxrec.models.deepfm``, as in TorchRec.
"""

from ..modules.torchrec_state import load_torchrec_state_dict as load_torchrec_state_dict
from ..modules.torchrec_state import torchrec_keys as torchrec_keys
from ..modules.torchrec_state import torchrec_state_dict as torchrec_state_dict
from .deepfm import FMInteractionArch as FMInteractionArch
from .deepfm import SimpleDeepFMNN as SimpleDeepFMNN
from .dlrm import DLRM as DLRM
from .dlrm import DLRM_DCN as DLRM_DCN
from .dlrm import DenseArch as DenseArch
from .dlrm import DLRM_Projection as DLRM_Projection
from .dlrm import InteractionArch as InteractionArch
from .dlrm import InteractionDCNArch as InteractionDCNArch
from .dlrm import InteractionProjectionArch as InteractionProjectionArch
from .dlrm import OverArch as OverArch
from .dlrm import SparseArch as SparseArch
from .two_tower import TwoTower as TwoTower
from .two_tower import TwoTowerTrainTask as TwoTowerTrainTask
from .two_tower import in_batch_softmax_loss as in_batch_softmax_loss
from .two_tower import top_k_candidates as top_k_candidates
