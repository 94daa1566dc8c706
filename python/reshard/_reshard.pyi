"""Type stubs of the native module (a thin PyO3 binding of the reshard library)."""

from os import PathLike
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple, TypedDict, Union

from typing_extensions import Unpack

__version__: str
CONVERT_OPTIONS: Tuple[str, ...]

class ReshardError(Exception):
    """Every error reshard raises: one line naming the file or tensor and the problem."""

class CheckpointError(ReshardError):
    """A checkpoint that cannot be read as its format says."""

class RequestError(ReshardError):
    """A request that cannot be carried out as asked."""

class ReshardIOError(ReshardError):
    """An operating-system error on a named file."""

class InternalError(ReshardError):
    """A bug in reshard (please report it)."""

_Part = Tuple[List[int], List[int], List[int]]
_Dest = Tuple[str, str, List[int], List[_Part], int, int]

class _StorageMeta(TypedDict):
    """``NativeCheckpoint.storage_meta``: torch's ``StorageMeta`` as saved, but ``load_id``."""

    checkpoint_id: Optional[str]  # the text (a path's as Python's str() of it), or None
    checkpoint_id_path: Optional[Literal["posix", "windows"]]  # saved as that pathlib path
    save_id: Optional[str]
    modules: List[str]

class NativeCheckpoint:
    """An open checkpoint: layouts and byte locations, no data."""

    @property
    def format(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def files(self) -> List[str]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def producer(self) -> Optional[str]: ...
    @property
    def storage_meta(self) -> Optional[_StorageMeta]:
        """What the writer recorded of the save (DCP's ``Metadata.storage_meta``), or None."""
    @property
    def metadata(self) -> List[Tuple[str, str]]: ...
    @property
    def nbytes(self) -> int: ...
    def tensors(self) -> List[Tuple[str, str, List[int], str]]:
        """Every tensor as ``(name, dtype, shape, layout summary)``."""
    def extra_names(self) -> List[str]:
        """The names of the non-tensor entries; nothing is read."""
    def extras(
        self, names: Optional[List[str]] = None
    ) -> List[Tuple[str, str, Optional[bytes], Optional[bytes], Optional[str]]]:
        """Every non-tensor entry (or those in ``names``) as ``(name, origin, raw, pickled, opaque)``."""
    def paths(self) -> Dict[str, List[Union[str, int]]]:
        """The nested path of each flat key that has one."""
    def tied_names(self) -> List[List[str]]:
        """Groups of tied tensors, by name."""
    def keeps(
        self, names: List[str], *, include: Optional[List[str]] = None, exclude: Optional[List[str]] = None
    ) -> List[bool]:
        """Which of ``names`` the include and exclude globs keep."""
    def local_regions(
        self,
        rank: int,
        world_size: int,
        *,
        layout: Optional[str] = None,
        include: Optional[List[str]] = None,
        exclude: Optional[List[str]] = None,
        dtype: Optional[str] = None,
    ) -> List[Tuple[str, str, List[int], List[int], List[int]]]:
        """The regions rank ``rank`` of ``world_size`` holds under a layout."""
    def read_into(self, dests: List[_Dest], progress: Optional[Callable[[int, int], Any]] = None) -> None:
        """Fill destinations ``(name, dtype, shape, parts, address, nbytes)`` in memory."""
    def recipe_targets(
        self, recipe: Optional[str] = None, params: Optional[str] = None, memory: bool = False
    ) -> Tuple[str, str, List[Tuple[str, str, List[int], str]]]:
        """The recipe, why, and the other framework's tensors ``(name, dtype, shape, view JSON)``;
        ``memory``: under the names a model holds in memory where they differ from its files'."""
    def read_views_into(
        self, dests: List[_Dest], views: List[str], progress: Optional[Callable[[int, int], Any]] = None
    ) -> None:
        """Fill destinations from views (JSON) of the tensors, as ``read_into`` does."""

def open(
    path: Union[str, "PathLike[str]"],
    *,
    format: Optional[str] = None,
    tag: Optional[str] = None,
    step: Optional[int] = None,
    weights: Optional[str] = None,
) -> NativeCheckpoint:
    """Open and validate a checkpoint of any supported format."""

def local_tensor(
    global_shape: Sequence[int], mesh: Sequence[int], placements: Sequence[str], coordinate: Sequence[int]
) -> Tuple[List[int], List[_Part]]:
    """What a mesh coordinate holds of a tensor under placements."""

class _ConvertOptions(TypedDict, total=False):
    """The keywords of ``convert`` after ``world_size`` (``CONVERT_OPTIONS``)."""

    format: Optional[str]
    layout: Optional[str]
    include: Optional[List[str]]
    exclude: Optional[List[str]]
    strip_prefix: Optional[str]
    add_prefix: Optional[str]
    dtype: Optional[str]
    max_shard_size: Optional[int]
    threads: Optional[int]
    per_rank_state: Optional[str]
    untie: bool
    overwrite: bool
    verify: bool
    progress: Optional[Callable[[int, int], Any]]
    dry_run: bool
    tag: Optional[str]
    step: Optional[int]
    weights: Optional[str]
    zero_stage: Optional[int]
    tp: Optional[int]
    pp: Optional[int]
    ep: Optional[int]
    save_dir: bool
    config: Optional[str]
    part: Optional[str]
    staging: Optional[str]
    recipe: Optional[str]
    params: Optional[str]

def convert(src: str, dst: str, *, world_size: int, **options: Unpack[_ConvertOptions]) -> Dict[str, Any]:
    """Convert a checkpoint (or one part of it: ``part`` "K/N" or "env"); a summary."""

def commit(
    dst: str, *, overwrite: bool = False, verify: bool = True, staging: Optional[str] = None
) -> int:
    """Commit a conversion run in parts; the bytes checked."""

def verify(path: str) -> Dict[str, Any]:
    """Check structure and recorded CRC-32s; a report."""

def diff(a: str, b: str) -> Dict[str, Any]:
    """Compare two checkpoints; the differences."""

def formats() -> List[Tuple[str, str]]:
    """The formats reshard reads and writes."""

def fetch_stats() -> Tuple[int, int]:
    """Ranged GETs sent to object stores by this process, and the bytes they returned."""

def is_url(path: str) -> bool:
    """Whether ``path`` is an object-store URL."""

def cli_main(argv: List[str]) -> int:
    """Run the command line and return its exit status."""
