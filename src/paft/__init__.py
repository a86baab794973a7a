"""paft: keep data-parallel PyTorch training correct when hardware silently corrupts numbers.

Inject silent data corruption (:mod:`paft.faults`), diagnose worker-level
inconsistency (:mod:`paft.consistency`), re-synchronize replicas (PAFT-Sync /
PAFT-Dyn, :mod:`paft.sync`, :mod:`paft.dyn`) and guard updates (:mod:`paft.guard`),
all wired around a standard DDP model by :func:`paft.protect`.
"""

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.protect import PersistentFaultError, Protector, StepReport, protect

__all__ = [
    "protect",
    "Protector",
    "StepReport",
    "PersistentFaultError",
    "MonitorConfig",
    "ProtectConfig",
    "GuardConfig",
    "__version__",
]
__version__ = "0.1.0"
