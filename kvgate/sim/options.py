"""Engine configuration: what a simulated engine looks like and how fast it runs."""

from dataclasses import dataclass, field
from typing import Literal

from .kv_event_wire import KV_EVENT_ENCODINGS, KvEventEncoding

Flavor = Literal["vllm", "sglang"]
ProfileName = Literal["realistic", "fast"]

DEFAULT_MODEL = "sim-model"
BLOCK_SIZE = 16
# An 8B model in bf16 on one 80 GB H100 at 0.9 memory utilization leaves about 55 GB for KV
# cache; at 128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes)
# that is about 430k tokens, i.e. about 27k blocks of 16 tokens.
DEFAULT_KV_BLOCKS = 27_000
DEFAULT_MAX_MODEL_LEN = 32_768
KV_EVENTS_PORT_OFFSET = 1000
# Not PUB + 1: engines listen on consecutive ports, so one engine's PUB + 1 is the next
# engine's PUB port.
KV_EVENTS_REPLAY_PORT_OFFSET = 2000
# vLLM keeps 10,000 batches for replay; a tenth keeps many in-process engines with long
# prompts (tens of kB per batch) within memory while covering seconds of traffic.
KV_EVENTS_REPLAY_BATCHES = 1000


@dataclass(frozen=True)
class TimingProfile:
    """Cost model of one engine step, in seconds before dividing by `speed`.

    step time = step_seconds + prefill_token_seconds x prefill tokens
                + decode_seq_seconds x decoding sequences
    `immediate` engines skip the scheduler entirely and answer as fast as the CPU allows.
    """

    step_seconds: float
    prefill_token_seconds: float
    decode_seq_seconds: float
    immediate: bool = False


PROFILES: dict[ProfileName, TimingProfile] = {
    # 8B model, one H100: ~15 ms per decode step at batch 1 (weights streamed once per step
    # plus launch overhead), ~0.2 ms more per sequence, prefill ~10k tokens/s.
    "realistic": TimingProfile(
        step_seconds=0.015, prefill_token_seconds=0.0001, decode_seq_seconds=0.0002
    ),
    "fast": TimingProfile(
        step_seconds=0.0, prefill_token_seconds=0.0, decode_seq_seconds=0.0, immediate=True
    ),
}


@dataclass
class EngineOptions:
    """Everything that distinguishes one simulated engine from another.

    `max_model_len=None` means min(32768, what fits in the KV cache); an explicit value
    larger than the KV cache is rejected, as vLLM refuses to start in that case.
    `fault` is a fault spec such as `{"mode": "http_error", "status": 503}` applied at start.
    `kv_events` publishes KV-cache events over ZMQ on the HTTP port + `kv_events_port_offset`
    in `kv_events_encoding`, and replays up to `kv_events_replay_batches` recent batches on
    the HTTP port + `kv_events_replay_port_offset`. `responses_store` keeps Responses API
    answers in the engine's memory, as vLLM does with `VLLM_ENABLE_RESPONSES_API_STORE=1`
    (kvgate/sim/response_store.py).
    """

    flavor: Flavor = "vllm"
    models: list[str] = field(default_factory=lambda: [DEFAULT_MODEL])
    profile: ProfileName = "realistic"
    speed: float = 1.0
    kv_blocks: int = DEFAULT_KV_BLOCKS
    block_size: int = BLOCK_SIZE
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    embedding_dim: int = 384
    fault: dict | None = None
    kv_events: bool = False
    kv_events_port_offset: int = KV_EVENTS_PORT_OFFSET
    kv_events_replay_port_offset: int = KV_EVENTS_REPLAY_PORT_OFFSET
    kv_events_encoding: KvEventEncoding = "array"
    kv_events_replay_batches: int = KV_EVENTS_REPLAY_BATCHES
    responses_store: bool = False

    def __post_init__(self) -> None:
        if self.flavor not in ("vllm", "sglang"):
            raise ValueError(f"unknown flavor {self.flavor!r}")
        if self.profile not in PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}")
        if not self.models:
            raise ValueError("at least one model name is needed")
        if self.speed <= 0:
            raise ValueError("speed must be positive")
        if self.kv_blocks < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("kv_blocks, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_events_encoding not in KV_EVENT_ENCODINGS:
            raise ValueError(f"unknown kv events encoding {self.kv_events_encoding!r}")
        offsets = (self.kv_events_port_offset, self.kv_events_replay_port_offset)
        if min(offsets) < 1 or self.kv_events_replay_batches < 1:
            raise ValueError("kv events port offsets and replay batches must be >= 1")
        if offsets[0] == offsets[1]:
            raise ValueError("kv events PUB and replay sockets need different port offsets")
        capacity = self.kv_blocks * self.block_size
        if self.max_model_len is None:
            self.max_model_len = min(DEFAULT_MAX_MODEL_LEN, capacity)
        elif self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} needs more KV cache than "
                f"{self.kv_blocks} blocks of {self.block_size} tokens hold"
            )

    @property
    def timing(self) -> TimingProfile:
        """The step-cost constants of `profile`."""
        return PROFILES[self.profile]

    @property
    def context_length(self) -> int:
        """`max_model_len` after defaulting (always set once constructed)."""
        assert self.max_model_len is not None
        return self.max_model_len
