"""The package's objects under their historical module path: ``from gpupool.client import
Client`` keeps working. Each lives in a module of its own (_client, _tensor, _dict, _holds)."""

from ._client import Client
from ._dict import TensorDict
from ._errors import GpupoolError
from ._tensor import Tensor
from ._util import stream_handle

__all__ = ["Client", "Tensor", "TensorDict", "GpupoolError", "stream_handle"]
