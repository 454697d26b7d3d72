"""The HTTP surface per flavour: metrics, errors, loads, models, embeddings, the OpenAI SDK."""

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.sim import EngineOptions, SimFleet

from .helpers import LONG_TEXT, chat_body

VLLM_FAMILIES = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:cache_config_info",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:num_preemptions",
}
SGLANG_FAMILIES = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:cached_tokens",
    "sglang:cache_config_info",
    "sglang:time_to_first_token_seconds",
    "sglang:inter_token_latency_seconds",
    "sglang:prompt_tokens",
    "sglang:generation_tokens",
}


def _samples(text: str) -> dict[str, list]:
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_metrics_parse_and_reflect_prefix_hits(flavor):
    options = EngineOptions(flavor=flavor, speed=50, kv_blocks=500)
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        url = fleet.urls[0]
        for _ in range(3):
            body = chat_body(LONG_TEXT * 5, max_tokens=5, ignore_eos=True)
            assert (await client.post(f"{url}/v1/chat/completions", json=body)).status_code == 200
        families = _samples((await client.get(f"{url}/metrics")).text)
    expected = VLLM_FAMILIES if flavor == "vllm" else SGLANG_FAMILIES
    assert expected <= set(families)
    for samples in families.values():
        assert all(sample.labels["model_name"] == "sim-model" for sample in samples)
    if flavor == "vllm":
        assert families["vllm:prefix_cache_hits"][0].value > 0
        assert families["vllm:prefix_cache_hits"][0].labels["engine"] == "0"
        info = families["vllm:cache_config_info"][0].labels
        assert (info["block_size"], info["num_gpu_blocks"]) == ("16", "500")
        ttft_count = [
            s for s in families["vllm:time_to_first_token_seconds"] if s.name.endswith("_count")
        ]
        assert ttft_count[0].value == 3
        assert families["vllm:generation_tokens"][0].value == 15
    else:
        assert families["sglang:cached_tokens"][0].value > 0
        assert 0 < families["sglang:cache_hit_rate"][0].value < 1
        info = families["sglang:cache_config_info"][0].labels
        assert (info["page_size"], info["num_pages"]) == ("16", "500")


async def test_sglang_loads_and_legacy_get_load():
    options = EngineOptions(flavor="sglang", profile="fast")
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        loads = (await client.get(f"{fleet.urls[0]}/v1/loads")).json()
        legacy = (await client.get(f"{fleet.urls[0]}/get_load")).json()
    rank = loads["loads"][0]
    assert rank["dp_rank"] == 0
    assert {"num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"} <= set(rank)
    assert legacy == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
async def test_too_long_prompt_is_a_400_before_any_stream(flavor):
    options = EngineOptions(flavor=flavor, profile="fast", kv_blocks=64, max_model_len=256)
    body = chat_body(LONG_TEXT * 20, stream=True)
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        response = await client.post(f"{fleet.urls[0]}/v1/chat/completions", json=body)
        unknown = await client.post(
            f"{fleet.urls[0]}/v1/completions", json={"model": "nope", "prompt": "x"}
        )
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    if flavor == "vllm":
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["code"] == 400 and error["type"] == "BadRequestError"
        assert "maximum context length is 256" in error["message"]
        assert unknown.json()["error"]["code"] == 404
    else:
        error = response.json()
        assert error["object"] == "error" and error["code"] == 400 and error["param"] is None
        assert "context length" in error["message"]
        assert unknown.json()["code"] == 404
    assert unknown.status_code == 404


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", "hot"),
        ("temperature", -3),
        ("top_p", 5),
        ("top_p", 0),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("top_k", -2),
        ("top_k", 1.5),
        ("seed", "s"),
    ],
)
async def test_sampling_parameters_out_of_range_are_a_400_naming_them(field, value):
    options = EngineOptions(profile="fast")
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        bad = await client.post(
            f"{fleet.urls[0]}/v1/chat/completions", json={**chat_body("hi"), field: value}
        )
        good = await client.post(
            f"{fleet.urls[0]}/v1/completions",
            json={"model": "sim-model", "prompt": "hi", "max_tokens": 2, "temperature": 0,
                  "top_p": 1, "top_k": -1, "seed": 7, "repetition_penalty": 1.1},
        )  # fmt: skip
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert good.status_code == 200


async def test_an_empty_completion_prompt_is_a_400():
    options = EngineOptions(profile="fast")
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        response = await client.post(
            f"{fleet.urls[0]}/v1/completions", json={"model": "sim-model", "prompt": ""}
        )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Prompt cannot be empty"


async def test_models_health_embeddings_and_priority():
    options = EngineOptions(profile="fast", models=["alpha", "beta"], scheduling_policy="fcfs")
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        url = fleet.urls[0]
        models = (await client.get(f"{url}/v1/models")).json()
        health = await client.get(f"{url}/health")
        first = (
            await client.post(
                f"{url}/v1/embeddings", json={"model": "beta", "input": ["a b c", "d"]}
            )
        ).json()
        again = (await client.post(f"{url}/v1/embeddings", json={"input": "a b c"})).json()
        priority = await client.post(
            f"{url}/v1/chat/completions", json={**chat_body("x"), "model": "alpha", "priority": 3}
        )
    assert [model["id"] for model in models["data"]] == ["alpha", "beta"]
    assert health.status_code == 200
    assert len(first["data"]) == 2 and len(first["data"][0]["embedding"]) == 384
    assert first["data"][0]["embedding"] == again["data"][0]["embedding"]
    assert priority.status_code == 400  # vLLM's default fcfs policy rejects priorities


async def test_fast_profile_serves_many_requests_with_correct_usage():
    options = EngineOptions(profile="fast")
    async with SimFleet(1, options=options) as fleet, httpx.AsyncClient(timeout=10) as client:
        url = fleet.urls[0]
        body = chat_body(
            LONG_TEXT * 3,
            max_tokens=8,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        for _ in range(50):
            response = await client.post(f"{url}/v1/chat/completions", json=body)
            assert response.text.endswith("data: [DONE]\n\n")
        stats = fleet.engines[0].stats()
    assert stats["requests_completed"] == 50
    assert stats["tokens_generated"] == 400
    assert '"cached_tokens":' in response.text and '"cached_tokens":0' not in response.text


def test_openai_sdk_streams_chat_and_completions_from_a_threaded_fleet():
    options = EngineOptions(speed=50)
    with SimFleet.in_thread(engines=1, options=options) as fleet:
        client = openai.OpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="unused")
        chunks = list(
            client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        completion = list(
            client.completions.create(
                model="sim-model",
                prompt="hello",
                max_tokens=6,
                stream=True,
            )
        )
        client.close()
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert "".join(chunk.choices[0].text for chunk in completion)


async def test_async_openai_sdk_reports_cached_tokens():
    async with SimFleet(1, options=EngineOptions(speed=50)) as fleet:
        client = openai.AsyncOpenAI(base_url=f"{fleet.urls[0]}/v1", api_key="unused")
        messages = [{"role": "user", "content": LONG_TEXT * 4}]
        await client.chat.completions.create(model="sim-model", messages=messages, max_tokens=2)
        again = await client.chat.completions.create(
            model="sim-model", messages=messages, max_tokens=2
        )
        await client.close()
    assert again.usage.prompt_tokens_details.cached_tokens > 0


async def test_role_chunk_leaves_with_the_first_token_as_on_vllm():
    """The opening role chunk must not arrive before prefill is done: gateways commit and time
    the first token on the first event."""
    options = EngineOptions(profile="realistic", speed=4)
    async with SimFleet(engines=1, options=options) as fleet, httpx.AsyncClient() as client:
        body = chat_body(LONG_TEXT, max_tokens=3)
        async with client.stream(
            "POST", fleet.urls[0] + "/v1/chat/completions", json={**body, "stream": True}
        ) as response:
            first = await anext(response.aiter_raw())
    assert b'"role":"assistant"' in first
    assert first.count(b"data: ") >= 2  # the role chunk and the first token, together


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_request_is_named_as_the_engine_names_it(flavor):
    """vLLM names a request by its X-Request-Id header, else by the body's `request_id`;
    SGLang reads no header."""
    options = EngineOptions(speed=50, flavor=flavor)
    with SimFleet.in_thread(engines=1, options=options) as fleet:
        url = fleet.urls[0] + "/v1/chat/completions"
        body = chat_body("hello", max_tokens=2, request_id="from-body")
        headed = httpx.post(url, json=body, headers={"x-request-id": "from-header"}, timeout=10)
        plain = httpx.post(url, json=body, timeout=10)
    named = "from-header" if flavor == "vllm" else "from-body"
    assert headed.json()["id"] == f"chatcmpl-{named}"
    assert plain.json()["id"] == "chatcmpl-from-body"


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_chat_stream_ends_as_the_engine_ends_it(flavor):
    """vLLM puts the finish reason (and `stop_reason`) on the last content chunk; SGLang sends
    it in a chunk of its own with an empty delta, naming the stop `matched_stop`."""
    options = EngineOptions(speed=50, flavor=flavor)
    with SimFleet.in_thread(engines=1, options=options) as fleet:
        body = chat_body("hello", max_tokens=3, stream=True, ignore_eos=True)
        raw = httpx.post(fleet.urls[0] + "/v1/chat/completions", json=body, timeout=10).content
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    choices = [orjson.loads(e)["choices"][0] for e in events[:-1]]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    assert [c["finish_reason"] for c in choices].count("length") == 1 and text
    last = choices[-1]
    assert last["finish_reason"] == "length"
    if flavor == "sglang":
        assert last["delta"] == {} and last["matched_stop"] is None
        assert all("stop_reason" not in c for c in choices)
    else:
        assert last["delta"]["content"] and last["stop_reason"] is None
