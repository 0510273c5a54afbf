"""Low-rank matrix ODE blocks integrated by projector splitting, reversible step by step:
the KSL step and its exact reverse, reversal defect, rank enrichment, controllers, and
LowRankODEBlock trained by reversal from checkpoints."""

from ._audit import audit_gradients as audit_gradients
from ._block import LowRankODEBlock as LowRankODEBlock
from ._controller import AbstractController as AbstractController
from ._controller import DefectController as DefectController
from ._controller import FixedController as FixedController
from ._controller import MemoryBudget as MemoryBudget
from ._enrich import enrich as enrich
from ._field import BoundField as BoundField
from ._field import FactoredField as FactoredField
from ._field import MemoryField as MemoryField
from ._gated import GatedMemoryField as GatedMemoryField
from ._gated import SequenceClassifier as SequenceClassifier
from ._ksl import ksl_reverse as ksl_reverse
from ._ksl import ksl_step as ksl_step
from ._ksl import rank_ratio as rank_ratio
from ._ksl import reversal_defect as reversal_defect
from ._state import LowRankState as LowRankState
from ._tape import OdeSolution as OdeSolution

__all__ = ["AbstractController", "BoundField", "DefectController", "FactoredField", "FixedController",
           "GatedMemoryField", "LowRankODEBlock", "LowRankState", "MemoryBudget", "MemoryField",
           "OdeSolution", "SequenceClassifier", "audit_gradients", "enrich", "ksl_reverse", "ksl_step",
           "rank_ratio", "reversal_defect"]
