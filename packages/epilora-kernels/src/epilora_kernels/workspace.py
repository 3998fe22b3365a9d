"""The counters the kernels synchronize with, in a workspace the caller owns.

Split-K tiles (K1's and K2's) count their arriving splits, and the decode path's K2 counts the
rows K1 has quantized (`READY` and `PASSED`, the first two entries). Every kernel leaves the
counters it used at zero (the last to arrive resets them), so no launch needs a memset before
it: the scheme of the lock workspace of vLLM's Marlin kernels. Ops on one stream run one after
another and a kernel touches tile counters only once the kernel before it is complete (K2 under
PDL: after its wait), so every launch starts at the same offset.

Rules for an engine (what `Workspace` enforces where it can):

* One workspace per stream that runs our ops concurrently with others: two streams sharing one
  would count into the same counters. Calls without a workspace share their device's default.
* Size it before CUDA-graph capture (`Workspace.for_batches`, or run the largest batch once
  eagerly): a launch under capture that needs more raises `WorkspaceTooSmall` rather than
  allocate memory the graph does not own. A graph holds the buffer's address, so a buffer a
  graph captured is never freed: when an eager launch needs more, a larger buffer replaces it
  for new launches and the captured one is kept for the graphs.
* After a failed launch (an exception between K1 and K2, a killed kernel), `reset()` zeroes the
  counters in stream order. The launchers already do so when K2 fails to launch after K1.

Only the counters persist between launches. Intermediates (codes, h, split-K partials, the
output) are allocated per call from torch's caching allocator, which CUDA-graph capture serves
from the graph's private pool: they need no caller-owned buffer to be capture-safe.
"""

import torch
import triton

from epilora_kernels.batch import MAX_SLICES

READY = 0  # rows quantized by K1 (decode path)
PASSED = 1  # K2 programs past their wait on READY
TILES = 2  # first split-K tile counter

_MIN_TILES = 4094
_MIN_BLOCK = 16  # the smallest tile of every dimension (LaunchConfig): bounds the tile counts


class WorkspaceTooSmall(RuntimeError):
    """A launch needs more counters than a frozen (or captured) workspace holds."""


def normalized_device(device: torch.device | str) -> torch.device:
    # "cuda" and "cuda:0" name one device: keep the index, so that comparisons hold.
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Workspace:
    """Zeroed int32 counters for the kernels on one device, owned by the caller.

    `tiles` is the number of split-K tile counters (after READY and PASSED). The buffer grows
    on demand: a larger one replaces it, and a buffer that a CUDA graph captured is kept alive
    beside it, so graphs keep a valid address (they go on using their own; new launches use
    the new one). It never grows during a capture (`WorkspaceTooSmall`: the launch would be
    captured with memory the graph does not own), nor once `freeze()` was called.
    """

    def __init__(self, device: torch.device | str, tiles: int = _MIN_TILES) -> None:
        if tiles < 0:
            raise ValueError(f"tiles must be >= 0, got {tiles}")
        self.device = normalized_device(device)
        self._buffer = torch.zeros(TILES + max(tiles, _MIN_TILES), dtype=torch.int32,
                                   device=self.device)
        self._captured = False  # whether a graph captured the current buffer
        self._kept: list[torch.Tensor] = []  # buffers graphs captured, replaced since
        self.frozen = False
        self._tiles_of: tuple[torch.Tensor, torch.Tensor] | None = None  # tile_counters'

    @classmethod
    def for_batches(cls, device: torch.device | str, *, max_tokens: int, max_out_features: int,
                    max_rank: int, max_loras: int) -> "Workspace":
        """A workspace large enough for every launch setting of every batch up to
        `max_tokens` tokens over projections of up to `max_out_features` outputs, adapters up
        to `max_rank` and `max_loras` slots: tile counts bounded with 16-wide tiles."""
        for name, value in (("max_tokens", max_tokens), ("max_out_features", max_out_features),
                            ("max_rank", max_rank), ("max_loras", max_loras)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        m = triton.cdiv(max_tokens, _MIN_BLOCK)
        k1 = (max_loras + 1) * m * triton.cdiv(max_rank, _MIN_BLOCK) * MAX_SLICES
        k2 = m * triton.cdiv(max_out_features, _MIN_BLOCK)
        return cls(device, max(k1, k2))

    @property
    def tiles(self) -> int:
        """Split-K tile counters available."""
        return self._buffer.numel() - TILES

    def freeze(self) -> None:
        """Never grow from now on: a launch that needs more raises `WorkspaceTooSmall` (for
        engines that size their workspace once and want to know if it ever falls short)."""
        self.frozen = True

    def counters(self, tiles: int) -> torch.Tensor:
        """The counter buffer, with room for `tiles` tile counters after READY and PASSED."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if tiles > self.tiles:
            if capturing or self.frozen:
                why = "during CUDA-graph capture" if capturing else "and is frozen"
                raise WorkspaceTooSmall(
                    f"this launch needs {tiles} split-K tile counters, the workspace has "
                    f"{self.tiles} {why}: size it before capture with "
                    f"Workspace.for_batches(...) or Workspace(device, tiles={tiles}), or run "
                    "the largest batch once before capturing")
            if self._captured:
                self._kept.append(self._buffer)
            elif self.device.type == "cuda":
                # Freed once replaced: not before the kernels already queued on this stream
                # (which may not be the one it was allocated on) are done with it.
                self._buffer.record_stream(torch.cuda.current_stream(self.device))
            self._buffer = torch.zeros(TILES + max(tiles, 2 * self.tiles), dtype=torch.int32,
                                       device=self.device)
            self._captured = False
        if capturing:
            self._captured = True
        return self._buffer

    def tile_counters(self, counters: torch.Tensor) -> torch.Tensor:
        """`counters[TILES:]`, the split-K tile counters of a buffer `counters` returned: the
        view made once per buffer (a slice is a few microseconds of host time a launch, and
        eager steps launch hundreds)."""
        kept = self._tiles_of
        if kept is None or kept[0] is not counters:
            kept = self._tiles_of = (counters, counters[TILES:])
        return kept[1]

    def reset(self) -> None:
        """Zero every counter, in stream order (recovery after a failed launch)."""
        self._buffer.zero_()
        for kept in self._kept:
            kept.zero_()

    def is_clean(self) -> bool:
        """Whether every counter is zero, as after every complete launch (synchronizes)."""
        return not any(bool(b.any()) for b in (self._buffer, *self._kept))


_defaults: dict[torch.device, Workspace] = {}
_replaced: list[Workspace] = []  # former defaults: graphs may have captured their buffers


def set_default_workspace(workspace: Workspace) -> None:
    """Make `workspace` the one that calls without a workspace use on its device: how an engine
    hands its own to ops that take no workspace argument (`epilora_kernels.ops`). The one it
    replaces is kept alive: a graph may have captured it."""
    old = _defaults.get(workspace.device)
    if old is not None and old is not workspace:
        _replaced.append(old)
    _defaults[workspace.device] = workspace


def default_workspace(device: torch.device | str) -> Workspace:
    """The workspace of `device` for callers that pass none (created on first use unless
    `set_default_workspace` gave one), grown on demand outside captures. One per device: ops
    on concurrent streams of one device need a workspace each, passed explicitly."""
    device = normalized_device(device)
    workspace = _defaults.get(device)
    if workspace is None:
        workspace = _defaults[device] = Workspace(device)
    return workspace
