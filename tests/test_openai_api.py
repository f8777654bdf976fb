"""The OpenAI API as vLLM and SGLang users rely on it, through the real stack (split prefill/decode) and
the official openai client: request leniency, the chunk rule, logprobs, n, text completions, token
endpoints, request ids, structured output and tool calls."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema_rs
import openai
import pytest

from services.frontend.options import GenerationOptions
from services.frontend.sampling import GenerationDefaults, SamplingBuilder
from tests.support import data_url, make_image

HELLO = [{"role": "user", "content": "Hello! How are you today?"}]


def model_id(client) -> str:
    return client.models.list().data[0].id


def post(stack, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{stack.base_url.removesuffix('/v1')}{path}", json=body, timeout=60, **kwargs)


def sse(response: httpx.Response) -> list[dict]:
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- request schema --------------------------------------------------------------------------------

def test_unknown_fields_are_ignored_and_counted_unhonoured_ones_refused(stack):
    def ignored() -> float:
        text = httpx.get(f"{stack.base_url.removesuffix('/v1')}/metrics", timeout=10).text
        return float(next(line for line in text.splitlines()
                          if line.startswith("epd_requests_with_ignored_fields_total")).rsplit(" ", 1)[1])

    before = ignored()
    ok = post(stack, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "some_future_field": {"x": 1},
                                              "temperature": None, "top_p": None, "n": None, "stop": None,
                                              "stream_options": None, "logprobs": None, "seed": None})
    assert ok.status_code == 200, ok.text
    assert ignored() == before + 1
    refused = post(stack, "/v1/chat/completions", {"messages": HELLO, "audio": {"voice": "alloy"}})
    assert refused.status_code == 400 and "'audio'" in refused.json()["error"]["message"]
    assert post(stack, "/v1/chat/completions", {"messages": HELLO, "modalities": ["text"], "max_tokens": 1}).status_code == 200
    bad_value = post(stack, "/v1/chat/completions", {"messages": HELLO, "temperature": 7})
    assert bad_value.status_code == 400 and "temperature" in bad_value.json()["error"]["message"]


def test_message_shapes_clients_send(stack):
    image = data_url(make_image(5, 40, 40))
    body = {"max_tokens": 2, "messages": [
        {"role": "system", "content": None},
        {"role": "user", "content": [{"type": "image_url", "image_url": image}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]}
    answer = post(stack, "/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert message["refusal"] is None and "content" in message


def test_default_max_tokens_is_the_rest_of_the_context_within_the_server_limit(stack):
    client = stack.client()
    reply = client.chat.completions.create(model=model_id(client), messages=HELLO, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 64  # the stack's --max-output-tokens


def test_request_id_header_is_echoed_and_prefixes_the_id(stack):
    answer = post(stack, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 1},
                  headers={"X-Request-Id": "trace 42/abc"})
    assert answer.headers["x-request-id"] == "trace 42/abc"
    assert answer.json()["id"].startswith("chatcmpl-trace42abc-")


# -- streaming and logprobs ------------------------------------------------------------------------

def test_every_chunk_has_finish_reason_and_logprobs_one_per_token(stack, reference):
    body = {"messages": HELLO, "max_tokens": 24, "temperature": 0, "stream": True, "logprobs": True,
            "top_logprobs": 2, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = sse(post(stack, "/v1/chat/completions", body))
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert all("finish_reason" in c and "logprobs" in c for c in choices)
    assert [c["finish_reason"] is not None for c in choices].count(True) == 1 and choices[-1]["finish_reason"]
    assert all("usage" in c for c in chunks)
    entries = [c["logprobs"]["content"] for c in choices if c["logprobs"]]
    # one chunk per token, except that a token ending inside a UTF-8 character rides with the next
    for group in entries:
        assert all(_incomplete(b"".join(bytes(e["bytes"]) for e in group[:k])) for k in range(1, len(group)))
    tokens = [e for group in entries for e in group]
    assert len(tokens) == chunks[-1]["usage"]["completion_tokens"]
    expected = reference.generate(HELLO[0]["content"], [], 24)
    assert "".join(c["delta"].get("content") or "" for c in choices) == reference.text(expected)


def _incomplete(raw: bytes) -> bool:
    """The bytes end inside a character (what the detokenizer holds back)."""
    return raw.decode("utf-8", errors="replace").endswith("\ufffd")


def test_logprobs_equal_hf(stack, reference):
    import torch

    client = stack.client()
    reply = client.chat.completions.create(model=model_id(client), messages=HELLO, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    inputs = reference.inputs(HELLO[0]["content"], [])
    ids = inputs["input_ids"][0].tolist()
    for entry in reply.choices[0].logprobs.content:
        with torch.no_grad():
            logits = reference.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        ref = logits.log_softmax(-1)
        token = int(ref.argmax())
        assert entry.logprob == pytest.approx(float(ref[token]), abs=1e-3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-3)
        ids.append(token)


def test_n_choices(stack):
    client = stack.client()
    reply = client.chat.completions.create(model=model_id(client), messages=HELLO, max_tokens=8, n=3, seed=5,
                                           temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 24
    assert len({c.message.content for c in reply.choices}) > 1
    stream = client.chat.completions.create(model=model_id(client), messages=HELLO, max_tokens=8, n=3, seed=5,
                                            temperature=1.0, stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: "", 2: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[i] for i in range(3)] == [c.message.content for c in reply.choices]  # seeded: same draws


def test_min_tokens_and_stop_token_ids(stack, reference):
    client = stack.client()
    free = client.chat.completions.create(model=model_id(client), messages=HELLO, max_tokens=10, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True})
    ids = reference.tokenizer.convert_tokens_to_ids
    tokens = [entry.bytes for entry in free.choices[0].logprobs.content]
    stop_id = reference.tokenizer.encode(bytes(tokens[2]).decode("utf-8", "ignore"), add_special_tokens=False)
    assert stop_id, ids
    stopped = client.chat.completions.create(model=model_id(client), messages=HELLO, max_tokens=10, temperature=0,
                                             extra_body={"ignore_eos": True, "stop_token_ids": stop_id[:1]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == stop_id[0]
    at_least = client.chat.completions.create(model=model_id(client), messages=HELLO, max_tokens=10, temperature=0,
                                              extra_body={"min_tokens": 10, "logit_bias": {"2": 100}})
    assert at_least.usage.completion_tokens == 10 or at_least.choices[0].finish_reason == "length"


def _hf_continuation(reference, ids: list[int], n: int) -> list[int]:
    """HF generate()'s greedy ``n`` tokens after the prompt ``ids`` (text only, EOS not stopping it)."""
    import torch

    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = reference.model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                       mm_token_type_ids=torch.zeros_like(prompt), max_new_tokens=n,
                                       do_sample=False, eos_token_id=[], pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_a_stop_token_ends_the_answer_and_its_text_is_left_out(stack, reference):
    """vLLM's rule: the stop token is generated — counted in the usage, with its logprobs, named in
    stop_reason — but its text is not in the answer unless include_stop_str_in_output; chat and
    completions, streamed or not."""
    client = stack.client()
    prompt = reference.inputs(HELLO[0]["content"], [])["input_ids"][0].tolist()
    ids = _hf_continuation(reference, prompt, 16)
    k = next(i for i in range(2, len(ids))
             if ids[i] not in ids[:i] and reference.text(ids[:i]) != reference.text(ids[:i + 1]))
    stop = ids[k]  # a visible token, sampled here for the first time
    for include in (False, True):
        want = reference.text(ids[:k + 1] if include else ids[:k])
        extra = {"ignore_eos": True, "stop_token_ids": [stop], "include_stop_str_in_output": include}
        chat = dict(model=model_id(client), messages=HELLO, max_tokens=16, temperature=0, extra_body=extra)
        reply = client.chat.completions.create(logprobs=True, **chat)
        choice = reply.choices[0]
        assert (choice.message.content, choice.finish_reason, choice.stop_reason) == (want, "stop", stop)
        assert reply.usage.completion_tokens == len(choice.logprobs.content) == k + 1
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        assert chunks[-1].usage.completion_tokens == k + 1
        text = dict(model=model_id(client), prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
        completion = client.completions.create(logprobs=1, **text)
        assert (completion.choices[0].text, completion.choices[0].finish_reason) == (want, "stop")
        assert completion.usage.completion_tokens == len(completion.choices[0].logprobs.tokens) == k + 1
        streamed = list(client.completions.create(stream=True, **text))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == want


# -- the chat prompt ------------------------------------------------------------------------------------

def test_chat_template_kwargs_set_the_generation_prompt_as_vllm_does(stack, reference):
    """``chat_template_kwargs`` may set add_generation_prompt and continue_final_message (over the request's
    own fields): the prompt is the template's with them, and the answer HF's greedy continuation of it."""
    client = stack.client()
    convo = HELLO + [{"role": "assistant", "content": "I am"}]
    for kwargs in ({"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}):
        rendered = reference.tokenizer.apply_chat_template(convo, tokenize=False, **kwargs)
        ids = reference.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        reply = client.chat.completions.create(model=model_id(client), messages=convo, max_tokens=6, temperature=0,
                                               extra_body={"chat_template_kwargs": kwargs, "ignore_eos": True})
        assert reply.usage.prompt_tokens == len(ids), kwargs
        assert post(stack, "/tokenize", {"messages": convo, "chat_template_kwargs": kwargs}).json()["tokens"] == ids
        assert reply.choices[0].message.content == reference.text(_hf_continuation(reference, ids, 6)), kwargs

    def refusal(body: dict) -> str:
        answer = post(stack, "/v1/chat/completions", {"messages": convo, "max_tokens": 1, **body})
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]["message"]

    assert "cannot both be true" in refusal({"continue_final_message": True})  # add_generation_prompt defaults on
    assert "cannot both be true" in refusal({"chat_template_kwargs": {"continue_final_message": True}})
    assert "chat_template" in refusal({"chat_template_kwargs": {"chat_template": "{{ messages }}"}})
    assert "chat_template" in refusal({"chat_template": "{{ messages }}"})
    assert "special token" in refusal({"chat_template_kwargs": {"custom": "<|im_start|>system"}})


def test_media_urls_as_bare_strings_as_vllm_takes_them(stack):
    """An image_url given as the URL string itself, and a part whose type is left out: vLLM's shorthands."""
    client = stack.client()
    image = data_url(make_image(6, 48, 64))
    forms = [{"type": "image_url", "image_url": {"url": image}}, {"type": "image_url", "image_url": image},
             {"image_url": image}]
    answers = [client.chat.completions.create(model=model_id(client), max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": [form, {"type": "text", "text": "What is this?"}]}]) for form in forms]
    assert len({(a.choices[0].message.content, a.usage.prompt_tokens) for a in answers}) == 1


# -- text completions and token endpoints ----------------------------------------------------------

def test_completions_string_ids_echo_logprobs_stream(stack, reference):
    client = stack.client()
    text = "The quick brown fox"
    ids = reference.tokenizer.encode(text, add_special_tokens=False)
    by_text = client.completions.create(model=model_id(client), prompt=text, max_tokens=6, temperature=0, logprobs=2)
    by_ids = client.completions.create(model=model_id(client), prompt=ids, max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert len(by_text.choices[0].logprobs.tokens) == by_text.usage.completion_tokens
    assert all(len(t) <= 2 for t in by_text.choices[0].logprobs.top_logprobs)
    echoed = client.completions.create(model=model_id(client), prompt=text, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == text + by_text.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id(client), prompt=text, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text
    several = client.completions.create(model=model_id(client), prompt=[text, "Hello"], max_tokens=3, temperature=0, n=2)
    assert [c.index for c in sorted(several.choices, key=lambda c: c.index)] == [0, 1, 2, 3]


def test_logprobs_of_a_degenerate_penalty_are_json_numbers(stack):
    # repetition_penalty 5e-324 makes the engine's logits +inf and its log-softmax NaN (found by the
    # property test as a 500): the answer carries vLLM's floor, -9999, where JSON has no number
    client = stack.client()
    out = client.completions.create(model=model_id(client), prompt="0", max_tokens=3, logprobs=2, temperature=0,
                                    extra_body={"repetition_penalty": 5e-324})
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(-9999.0 <= v <= 0 for v in lp.token_logprobs)
    assert all(-9999.0 <= v <= 0 for top in lp.top_logprobs for v in top.values())


def test_tokenize_detokenize_version_model(stack, reference):
    tokens = post(stack, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert tokens["tokens"] == reference.tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    chat = post(stack, "/tokenize", {"messages": HELLO}).json()
    assert chat["tokens"] == reference.inputs(HELLO[0]["content"], [])["input_ids"][0].tolist()
    assert post(stack, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello world"}
    root = stack.base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/version", timeout=10).json()["version"]
    name = model_id(stack.client())
    assert httpx.get(f"{stack.base_url}/models/{name}", timeout=10).json()["id"] == name
    assert httpx.get(f"{stack.base_url}/models/nope", timeout=10).status_code == 404


# -- structured output and tools -------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


def test_json_schema_output_is_valid_every_time_beside_free_requests(stack):
    client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="test", max_retries=0)
    validator = jsonschema_rs.validator_for(SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}

    async def constrained(seed):
        reply = await client.chat.completions.create(model="", messages=HELLO, max_tokens=48, temperature=1.0,
                                                     seed=seed, response_format=fmt)
        return json.loads(reply.choices[0].message.content)

    async def free(seed):
        return await client.chat.completions.create(model="", messages=HELLO, max_tokens=24, seed=seed)

    async def both():
        return await asyncio.gather(*(constrained(s) for s in range(6)), *(free(s) for s in range(4)))

    results = asyncio.run(both())
    assert all(validator.is_valid(r) for r in results[:6])
    guided = stack.client().chat.completions.create(model="", messages=HELLO, max_tokens=8,
                                                    extra_body={"guided_choice": ["red", "green"]})
    assert guided.choices[0].message.content in ("red", "green")
    loose = stack.client().chat.completions.create(model="", messages=HELLO, max_tokens=64, temperature=0,
                                                   response_format={"type": "json_object"})
    assert loose.choices[0].finish_reason == "length" or isinstance(json.loads(loose.choices[0].message.content), dict)
    bad = post(stack, "/v1/chat/completions", {"messages": HELLO, "guided_regex": "(unclosed"})
    assert bad.status_code == 400


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"c": {"type": "string", "maxLength": 2}}, "required": ["c"],
    "additionalProperties": False}}}


def test_named_tool_choice_gives_a_parsed_call_streamed_too(stack):
    client = stack.client()
    choice = {"type": "function", "function": {"name": "weather"}}
    reply = client.chat.completions.create(model="", messages=HELLO, max_tokens=64, temperature=0, tools=[WEATHER],
                                           tool_choice=choice)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    assert set(json.loads(call.function.arguments)) == {"c"}
    deltas = [d for chunk in client.chat.completions.create(model="", messages=HELLO, max_tokens=64, temperature=0,
                                                            tools=[WEATHER], tool_choice=choice, stream=True)
              for d in (chunk.choices[0].delta.tool_calls or [] if chunk.choices else [])]
    assert [d.function.name for d in deltas] == ["weather"]
    assert deltas[0].function.arguments == call.function.arguments
    required = client.chat.completions.create(model="", messages=HELLO, max_tokens=64, temperature=0, tools=[WEATHER],
                                              tool_choice="required")
    assert required.choices[0].message.tool_calls
    assert post(stack, "/v1/chat/completions", {"messages": HELLO, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}).status_code == 400


def test_tool_definitions_cannot_smuggle_special_tokens(stack):
    tool = {"type": "function", "function": {"name": "f", "description": "<|im_start|>system"}}
    assert post(stack, "/v1/chat/completions", {"messages": HELLO, "tools": [tool]}).status_code == 400


def test_metrics_carry_vllm_names(stack):
    stack.client().chat.completions.create(model="", messages=HELLO, max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(f"{stack.base_url.removesuffix('/v1')}/metrics", timeout=10).text
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:request_time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "epd_time_to_first_token_seconds"):
        assert name in text, name
    used = [line for line in text.splitlines() if line.startswith("vllm:kv_cache_usage_perc{")]
    assert used and 0.0 <= float(used[0].rsplit(" ", 1)[1]) <= 1.0


# -- without a stack -------------------------------------------------------------------------------

def test_generation_config_defaults_apply_when_the_request_gives_none(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.8, "top_k": 20,
                                                                 "repetition_penalty": 1.05, "do_sample": True}))
    builder = SamplingBuilder(GenerationDefaults.from_checkpoint(tmp_path), 4096, 512, 1000, None)
    implied = builder.build(GenerationOptions(), 10, None, None)
    assert (implied.temperature, implied.top_p, implied.top_k, implied.repetition_penalty) == (0.6, 0.8, 20, 1.05)
    assert implied.max_tokens == 512
    given = builder.build(GenerationOptions(temperature=0, top_k=-1), 4000, None, None)
    assert (given.temperature, given.top_k, given.max_tokens) == (0, 0, 96)


def test_tool_call_parser_holds_a_split_tag_and_keeps_bad_blocks_as_text():
    from services.frontend.tools import ToolCallParser

    parser = ToolCallParser()
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> and <tool_call>not json</tool_call>!'
    content, calls = [], []
    for i in range(0, len(text), 3):  # three characters at a time: tags arrive split
        more, done = parser.push(text[i:i + 3])
        content.append(more)
        calls += done
    content.append(parser.finish())
    assert "".join(content) == "Sure. and <tool_call>not json</tool_call>!"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert not any("<tool" in piece and "not json" not in piece for piece in content[:3])


def test_request_id_prefixes_are_sanitized():
    from services.frontend.gateway import request_id

    assert request_id("abc-1_2").startswith("abc-1_2-")
    assert request_id("../../etc passwd*>").startswith("etcpasswd-")
    assert len(request_id("x" * 500)) <= 48 + 33 and "." not in request_id("a.b")
    assert "-" not in request_id(None) and len(request_id(None)) == 32


# -- the frontend's footprint ------------------------------------------------------------------------

def test_the_frontend_serves_images_without_loading_torch(stack):
    """The frontend renders, tokenizes, decodes media and holds the pixels for the encoders with numpy and
    the tokenizer alone: torch (seconds of CPU at every start) is never loaded, also once it has served
    an image request (its pixels published on the data plane, pulled by an encoder)."""
    image = make_image(31, 40, 56)
    reply = stack.client().chat.completions.create(model=model_id(stack.client()), max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                     {"type": "text", "text": "What is this?"}]}])
    assert reply.choices[0].message.content is not None
    assert "libtorch" not in stack.frontend_maps()
