"""paft: keep data-parallel PyTorch training correct when hardware silently corrupts numbers.

Inject silent data corruption (:mod:`paft.faults`), diagnose worker-level
inconsistency (:mod:`paft.consistency`), re-synchronize replicas (PAFT-Sync /
PAFT-Dyn, :mod:`paft.sync`, :mod:`paft.dyn`) and guard updates (:mod:`paft.guard`),
all wired around a standard DDP model by :func:`paft.protect`.
"""

from paft.startup import exit_on_interrupt

# Before torch is imported, which takes a paft command its first second or two.
exit_on_interrupt()

from paft.config import GuardConfig, MonitorConfig, ProtectConfig  # noqa: E402
from paft.optimizers import OptimizerChain  # noqa: E402
from paft.protect import PersistentFaultError, Protector, StepReport, protect  # noqa: E402

__all__ = [
    "protect",
    "Protector",
    "StepReport",
    "PersistentFaultError",
    "MonitorConfig",
    "ProtectConfig",
    "GuardConfig",
    "OptimizerChain",
    "__version__",
]
__version__ = "0.1.0"
