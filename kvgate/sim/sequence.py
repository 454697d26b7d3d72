"""One generation request as the engine core tracks it, and the stream its handler reads."""

import asyncio
import itertools
from dataclasses import dataclass, field

from .textgen import TAIL_CHARS

_arrival_order = itertools.count()


@dataclass
class SamplingParams:
    """What the client asked for that shapes the output."""

    max_tokens: int
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    priority: int = 0
    cache_salt: str | None = None


@dataclass(slots=True)
class FirstTokenTime:
    """Where a request's time to first token went inside the engine, in seconds: its share of
    the steps it took part in before its first token, split by what each step computed (the
    rest of that time it waited for a step to take it)."""

    step_base: float = 0.0  # the fixed cost of those steps
    own_prefill: float = 0.0  # computing its own prompt
    shared_prefill: float = 0.0  # other requests' prefill in the same steps
    decodes: float = 0.0  # decoding sequences in the same steps
    overrun: float = 0.0  # those steps running past their modelled time (a busy host CPU)

    def total(self) -> float:
        return self.step_base + self.own_prefill + self.shared_prefill + self.decodes + self.overrun


@dataclass(eq=False)
class GenerationRequest:
    """State of one request from submission to finish.

    The engine core appends to `output_tokens` and sets `finish_reason` (one of "stop",
    "length", "abort"); the HTTP handler reads them after each `wait_for_progress()`.
    `text_limit` is set when a stop string truncates the visible text.
    """

    request_id: str
    prompt: str
    prompt_tokens: list[str]
    params: SamplingParams
    arrival: float
    order: int = field(default_factory=lambda: next(_arrival_order))
    all_tokens: list[str] = field(init=False)
    output_tokens: list[str] = field(default_factory=list)
    output_chars: int = 0
    text_limit: int | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    cached_tokens: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    first_token_time: FirstTokenTime = field(default_factory=FirstTokenTime)
    # KV bookkeeping owned by the engine core.
    block_hashes: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_registered_blocks: int = 0
    tail: str = field(init=False)
    _progress: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.all_tokens = list(self.prompt_tokens)
        self.tail = self.prompt[-TAIL_CHARS:]

    @property
    def finished(self) -> bool:
        """True once the request stopped, hit its length limit or was aborted."""
        return self.finish_reason is not None

    @property
    def schedule_key(self) -> tuple[int, int]:
        """Waiting-queue order: lower priority value first, then arrival order."""
        return (self.params.priority, self.order)

    def notify(self) -> None:
        """Wake the handler: new tokens arrived or the request finished."""
        self._progress.set()

    async def wait_for_progress(self) -> None:
        """Return once something changed since the previous call (or immediately if it has)."""
        await self._progress.wait()
        self._progress.clear()
