"""durable_steps: crash-resumable agent loops with nothing but a bucket.

The loop's state is checkpointed to object storage (S3 and compatible
services, or a local directory) after every committed step; rerunning the
same script resumes where it stopped. See the README for the guarantees.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from . import testing
from ._events import Event, Progress
from ._execution.context import Context
from ._step import Fired, Retry, Step, step
from ._version import __version__
from ._workflow import Workflow
from .errors import (
    CheckpointConflict,
    ConditionalWritesUnsupported,
    CorruptCheckpoint,
    DefinitionError,
    DurableStepsError,
    RunLocked,
    RunNotFound,
    RunSuspended,
    SerializationError,
    SignalRefused,
    SignalTimeout,
    StepFailed,
    StepInDoubt,
    StoreError,
    WorkflowChanged,
)
from .serializers import JSONSerializer, PickleSerializer, Serializer, SignedSerializer
from .stores import LocalStore, MemoryStore, ObjectInfo, Store, open_store
from .worker import Worker, WorkerReport

if TYPE_CHECKING:
    from .stores.azure import AzureBlobStore
    from .stores.gcs import GCSStore
    from .stores.s3 import S3Store

__all__ = [
    "AzureBlobStore",
    "CheckpointConflict",
    "ConditionalWritesUnsupported",
    "Context",
    "CorruptCheckpoint",
    "DefinitionError",
    "DurableStepsError",
    "Event",
    "Fired",
    "GCSStore",
    "JSONSerializer",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "PickleSerializer",
    "Progress",
    "Retry",
    "RunLocked",
    "RunNotFound",
    "RunSuspended",
    "S3Store",
    "SerializationError",
    "Serializer",
    "SignalRefused",
    "SignalTimeout",
    "SignedSerializer",
    "Step",
    "StepFailed",
    "StepInDoubt",
    "Store",
    "StoreError",
    "Worker",
    "WorkerReport",
    "Workflow",
    "WorkflowChanged",
    "__version__",
    "open_store",
    "step",
    "testing",
]


def __getattr__(name: str) -> Any:
    # The cloud SDKs take a while to import (and GCS's and Azure's are
    # optional extras): load one only when its store is used.
    if name in ("S3Store", "GCSStore", "AzureBlobStore"):
        from . import stores

        return getattr(stores, name)
    raise AttributeError(f"module 'durable_steps' has no attribute {name!r}")


def _keep_pickled_paths() -> None:
    """Old module paths that stored runs can name, kept importable (issue 37 moved them).

    cloudpickle writes an importable class by module path, so a pickled state
    holding a Context (or a class of the user's annotated with it), a ForkRefused
    or a Suspend names the module it was in; these entries keep such runs loading
    (tests/test_layout.py loads one).
    """
    for old, new in {
        "_context": "_execution.context",
        "_fork": "_deploys.fork",
        "_waits": "_execution.waits",
    }.items():
        sys.modules.setdefault(f"{__name__}.{old}", importlib.import_module(f"{__name__}.{new}"))


_keep_pickled_paths()
