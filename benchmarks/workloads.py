"""The routing benchmarks' workloads: open-loop request plans, each a deterministic function of
its arguments and `--seed` (same arguments and seed, same requests at the same offsets).

  shared   groups of prompts sharing a long system prompt (`--groups` x `--per-group`)
  sessions multi-turn chats whose context grows turn by turn (`--requests` / `--turns`
           sessions, each with its own system prompt, a turn every `--turn-gap` seconds, as an
           agent loop does; the `user` field names the session)
  mooncake the Mooncake FAST'25 synthetic trace (`--trace`; the public file from
           github.com/kvcache-ai/Mooncake, FAST25-release/traces/synthetic_trace.jsonl): each
           hash_id becomes a fixed block of synthetic text (`--block-chars`), so shared ids are
           shared text; lengths scaled down (a 512-token hash block becomes ~17 tokens)
  azure    conversations on the Azure LLM inference trace 2023 (`--azure-trace`): real
           arrival times and real context lengths, sessions derived (see `azure_conversations`)
  agents   agent loops: a long tool-and-instructions prefix shared by the agents of one kind,
           then many short turns in quick succession, several agents at once

Every rate is in requests per second; a workload's arrival times are scaled (trace) or drawn
(synthetic) so that its mean rate is the one asked for.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODEL = "sim-model"
# Local copies of the public files (README: Public traces): in $KVGATE_TRACE_DIR, else in the
# data folder that the benchmark machines keep beside the repository's checkout.
TRACE_DIR = Path(os.environ.get("KVGATE_TRACE_DIR") or Path(__file__).parents[2] / "shared/data")
DEFAULT_TRACE = TRACE_DIR / "mooncake" / "synthetic_trace.jsonl"
DEFAULT_AZURE_TRACE = TRACE_DIR / "azure" / "AzureLLMInferenceTrace_conv.csv"
_WORD_TEXT = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
    "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
    "zulu engine cache token prefix router stream window batch"
)
WORDS = tuple(_WORD_TEXT.split())
# Words of at most six letters are one simulator token each (with their leading space).
ONE_TOKEN_WORDS = tuple(w for w in WORDS if len(w) <= 6)
# Template tokens a chat message adds around its content (`<|im_start|>`, role, newline,
# `<|im_end|>`, newline), so a turn's text can be sized to the trace's context length.
MESSAGE_OVERHEAD_TOKENS = 5
ASSISTANT_OVERHEAD_TOKENS = 6  # "assistant" is two tokens
GENERATION_PROMPT_TOKENS = 4  # `<|im_start|>assistant\n`


def words(rng: random.Random, tokens: int) -> str:
    """About `tokens` simulator tokens of text (one word ≈ one token)."""
    return " ".join(rng.choice(WORDS) for _ in range(tokens))


def exact_words(rng: random.Random, tokens: int) -> str:
    """Text of exactly `tokens` simulator tokens (one-token words)."""
    return " ".join(rng.choice(ONE_TOKEN_WORDS) for _ in range(max(1, tokens)))


@dataclass(slots=True)
class Planned:
    at: float  # seconds from the start
    body: dict[str, Any]


def chat(
    messages: list[dict[str, str]], max_tokens: int, user: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    if user:
        body["user"] = user
    return body


def poisson(count: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def shared_prefix(rate: float, args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(f"shared/{args.seed}")
    systems = [words(rng, args.system_tokens) for _ in range(args.groups)]
    order = [(g, i) for g in range(args.groups) for i in range(args.per_group)]
    rng.shuffle(order)
    arrivals = poisson(len(order), rate, rng)
    return [
        Planned(
            t,
            chat(
                [
                    {"role": "system", "content": systems[g]},
                    {"role": "user", "content": f"{i}: " + words(rng, 128)},
                ],
                args.output_tokens,
            ),
        )
        for t, (g, i) in zip(arrivals, order, strict=True)
    ]


def sessions(rate: float, args: argparse.Namespace) -> list[Planned]:
    rng = random.Random(f"sessions/{args.seed}")
    turns, gap = args.turns, args.turn_gap
    count = max(1, round(args.requests / turns))
    starts = poisson(count, rate / turns, rng)
    plans = []
    for s, start in enumerate(starts):
        history = [{"role": "system", "content": words(rng, args.session_system_tokens)}]
        for t in range(turns):
            history = [*history, {"role": "user", "content": words(rng, 96)}]
            plans.append(
                Planned(
                    start + t * gap, chat(list(history), args.output_tokens, user=f"session-{s}")
                )
            )
            history.append({"role": "assistant", "content": words(rng, args.output_tokens)})
    return sorted(plans, key=lambda p: p.at)


def mooncake(rate: float, args: argparse.Namespace) -> list[Planned]:
    lines = args.trace.read_text().splitlines()[
        args.trace_offset : args.trace_offset + args.requests
    ]
    rows = [json.loads(line) for line in lines]
    blocks: dict[int, str] = {}

    def block(hash_id: int) -> str:
        if hash_id not in blocks:
            blocks[hash_id] = words(
                random.Random(f"mooncake/{args.seed}/{hash_id}"), args.block_chars // 5
            )
        return blocks[hash_id]

    span = max(1.0, (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000)
    scale = (len(rows) / rate) / span
    plans = []
    for row in rows:
        text = " ".join(block(h) for h in row["hash_ids"])
        output = max(1, min(args.output_tokens, row["output_length"] // 16))
        plans.append(
            Planned(
                (row["timestamp"] - rows[0]["timestamp"]) / 1000 * scale,
                chat([{"role": "user", "content": text}], output),
            )
        )
    return plans


@dataclass(slots=True)
class TraceRow:
    at: float  # seconds since the trace's first row
    context: int
    generated: int


def read_azure(path: Path, offset: int, count: int) -> list[TraceRow]:
    """`count` rows from `offset` of an Azure LLM inference trace CSV (`TIMESTAMP,
    ContextTokens,GeneratedTokens`, wall-clock timestamps with 7 fractional digits)."""
    with path.open(newline="") as trace:
        rows = list(csv.DictReader(trace))[offset : offset + count]

    def seconds(stamp: str) -> float:
        day, _, fraction = stamp.partition(".")
        whole = datetime.datetime.fromisoformat(day).timestamp()
        return whole + (float("0." + fraction) if fraction else 0.0)

    first = seconds(rows[0]["TIMESTAMP"])
    return [
        TraceRow(
            seconds(r["TIMESTAMP"]) - first, int(r["ContextTokens"]), int(r["GeneratedTokens"])
        )
        for r in rows
    ]


@dataclass(slots=True)
class _Conversation:
    messages: list[dict[str, str]]
    name: str
    last_at: float
    carried: int  # tokens of the history a next turn carries before its new user message


def azure_conversations(rate: float, args: argparse.Namespace) -> list[Planned]:
    """Multi-turn conversations with the Azure trace's arrival times and context lengths.

    The trace has no session ids, so sessions are derived, deterministically: rows are read
    in time order; a row continues the open conversation whose carried context (its last
    prompt plus the answer the trace says it got) is the largest that still leaves the row at
    least `--azure-min-user` tokens of new user message, among conversations whose last turn
    was between `--azure-min-gap` (reading and typing) and `--azure-max-gap` trace seconds
    earlier; if none qualifies the row opens a new conversation. So every prompt is exactly
    the trace's ContextTokens long (capped at `--azure-max-context`), contexts only grow
    within a conversation, and turn gaps are the trace's own gaps between the rows a
    conversation claims (seconds to minutes, heavy-tailed). A new conversation starts with
    one of `--azure-system-prompts` shared system prompts (of 150, 300, 600, ... tokens;
    picked by the seed among those leaving room for its first user message, none if none
    does). Arrival times are the trace's, compressed so the mean rate is `rate` (bursts stay
    bursts); the answer requested is min(GeneratedTokens, `--output-tokens`), while the
    history carries an answer of the trace's full GeneratedTokens.
    """
    rng = random.Random(f"azure/{args.seed}")
    rows = read_azure(args.azure_trace, args.azure_offset, args.azure_requests)
    system_tokens = [150 * 2**k for k in range(args.azure_system_prompts)]
    systems = [exact_words(rng, n) for n in system_tokens]
    span = max(1e-9, rows[-1].at - rows[0].at)
    scale = (len(rows) / rate) / span
    open_: list[_Conversation] = []
    opened = 0
    plans = []
    for row in rows:
        open_ = [c for c in open_ if row.at - c.last_at <= args.azure_max_gap]
        context = min(row.context, args.azure_max_context)
        room = context - args.azure_min_user - MESSAGE_OVERHEAD_TOKENS - GENERATION_PROMPT_TOKENS
        candidates = [
            c for c in open_ if row.at - c.last_at >= args.azure_min_gap and c.carried <= room
        ]
        chosen = max(candidates, key=lambda c: c.carried, default=None)
        if chosen is None:
            messages, carried = [], 0
            fitting = [
                k for k, n in enumerate(system_tokens) if n + MESSAGE_OVERHEAD_TOKENS <= room
            ]
            if fitting:
                k = rng.choice(fitting)
                messages.append({"role": "system", "content": systems[k]})
                carried = system_tokens[k] + MESSAGE_OVERHEAD_TOKENS
            chosen = _Conversation(messages, f"conv-{opened}", row.at, carried)
            opened += 1
            open_.append(chosen)
        user_tokens = context - chosen.carried - MESSAGE_OVERHEAD_TOKENS - GENERATION_PROMPT_TOKENS
        chosen.messages.append({"role": "user", "content": exact_words(rng, user_tokens)})
        plans.append(
            Planned(
                row.at * scale,
                chat(
                    list(chosen.messages),
                    max(1, min(row.generated, args.output_tokens)),
                    chosen.name,
                ),
            )
        )
        chosen.messages.append({"role": "assistant", "content": exact_words(rng, row.generated)})
        chosen.carried = (
            context - GENERATION_PROMPT_TOKENS + row.generated + ASSISTANT_OVERHEAD_TOKENS
        )
        chosen.last_at = row.at
    return plans


def agents(rate: float, args: argparse.Namespace) -> list[Planned]:
    """Agent loops: `--agents` agents of `--agent-kinds` kinds; the agents of one kind share a
    prefix of `--agent-prefix-tokens` (instructions and tool definitions), then each adds its
    own task (`--agent-task-tokens`) and runs `--agent-turns` turns in quick succession: every
    turn sends the whole history plus the last tool result (log-normal, median
    `--agent-tool-tokens`, heavy-tailed up to 16x; sent as a user message, since a peer router
    may refuse `tool` messages without the tool-call ids a real loop carries) `--agent-gap`
    seconds (exponential) after the previous turn, the answer being an `--output-tokens`
    action. Agents start as a Poisson process at `rate / --agent-turns` per second, so
    several loops run at once and the mean rate is about `rate`."""
    rng = random.Random(f"agents/{args.seed}")
    prefixes = [exact_words(rng, args.agent_prefix_tokens) for _ in range(args.agent_kinds)]
    starts = poisson(args.agents, rate / args.agent_turns, rng)
    plans = []
    for a, start in enumerate(starts):
        history = [
            {"role": "system", "content": prefixes[a % args.agent_kinds]},
            {"role": "user", "content": exact_words(rng, args.agent_task_tokens)},
        ]
        at = start
        for _ in range(args.agent_turns):
            plans.append(Planned(at, chat(list(history), args.output_tokens, f"agent-{a}")))
            tool = min(
                16 * args.agent_tool_tokens, rng.lognormvariate(0, 1) * args.agent_tool_tokens
            )
            history += [
                {"role": "assistant", "content": exact_words(rng, args.output_tokens)},
                {"role": "user", "content": exact_words(rng, round(tool))},
            ]
            at += rng.expovariate(1 / args.agent_gap)
    return sorted(plans, key=lambda p: p.at)


WORKLOADS = {
    "shared": shared_prefix,
    "sessions": sessions,
    "mooncake": mooncake,
    "azure": azure_conversations,
    "agents": agents,
}
TRACE_OF = {"mooncake": "trace", "azure": "azure_trace"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare every workload's options (defaults sized for 4 simulated engines)."""
    p.add_argument("--seed", type=int, default=0, help="every workload is a function of it")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--groups", type=int, default=16, help="shared: prompt groups")
    p.add_argument("--per-group", type=int, default=32, help="shared: prompts per group")
    p.add_argument("--system-tokens", type=int, default=2048, help="shared: common prefix")
    p.add_argument("--requests", type=int, default=384, help="sessions and mooncake")
    p.add_argument("--turns", type=int, default=12, help="sessions: turns per session")
    p.add_argument("--turn-gap", type=float, default=0.4, help="sessions: seconds between turns")
    p.add_argument("--session-system-tokens", type=int, default=512)
    p.add_argument(
        "--trace",
        type=Path,
        default=DEFAULT_TRACE,
        help="mooncake: the Mooncake synthetic trace (JSONL), the public file from the Mooncake "
        "project",
    )
    p.add_argument(
        "--trace-offset",
        type=int,
        default=3712,
        help="mooncake: first row to replay (later rows reuse more)",
    )
    p.add_argument(
        "--block-chars",
        type=int,
        default=96,
        help="mooncake: text per hash_id (512 tokens scaled to ~17)",
    )
    p.add_argument(
        "--azure-trace",
        type=Path,
        default=DEFAULT_AZURE_TRACE,
        help="azure: the Azure LLM inference trace 2023 (conversation CSV), the public file from "
        "Azure/AzurePublicDataset",
    )
    p.add_argument("--azure-offset", type=int, default=0, help="azure: first row to replay")
    p.add_argument("--azure-requests", type=int, default=600, help="azure: rows to replay")
    p.add_argument("--azure-system-prompts", type=int, default=4)
    p.add_argument("--azure-min-user", type=int, default=16, help="azure: tokens of a new turn")
    p.add_argument("--azure-min-gap", type=float, default=5.0, help="azure: trace seconds")
    p.add_argument("--azure-max-gap", type=float, default=600.0, help="azure: trace seconds")
    p.add_argument(
        "--azure-max-context",
        type=int,
        default=20_000,
        help="azure: longer prompts are cut (one engine of 1,400 blocks holds 22,400 tokens)",
    )
    p.add_argument("--agents", type=int, default=24, help="agents: agent loops")
    p.add_argument("--agent-kinds", type=int, default=3, help="agents: distinct shared prefixes")
    p.add_argument("--agent-prefix-tokens", type=int, default=3000)
    p.add_argument("--agent-task-tokens", type=int, default=300)
    p.add_argument("--agent-turns", type=int, default=20)
    p.add_argument("--agent-tool-tokens", type=int, default=60, help="agents: median result")
    p.add_argument("--agent-gap", type=float, default=0.3, help="agents: mean seconds")
