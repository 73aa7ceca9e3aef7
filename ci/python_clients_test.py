"""The official OpenAI and Anthropic Python SDKs against a live `strata serve` (started by ci/python-clients.sh).

Usage: python ci/python_clients_test.py http://127.0.0.1:PORT
Covers plain and streamed answers for both APIs, count_tokens, usage and error mapping to each SDK's exceptions.
"""

import sys

import anthropic
import openai

BASE = sys.argv[1].rstrip("/")
MODEL = "default"
QUESTION = "What is the capital of France?"
SYSTEM = "You are a helpful AI assistant."

oa = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0)
an = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0)


def test_openai_chat():
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in r.choices[0].message.content, r
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage
    assert r.choices[0].finish_reason in ("stop", "length")


def test_openai_chat_stream():
    chunks = list(
        oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
            temperature=0,
            max_completion_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text, text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0, chunks[-1]


def test_openai_completions_and_models():
    r = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, seed=1)
    assert r.usage.completion_tokens == 4, r.usage
    ids = [m.id for m in oa.models.list()]
    assert ids and ids[0].startswith("SmolLM2"), ids


def test_openai_errors():
    try:
        oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert "not served" in str(e), e
    try:
        oa.chat.completions.create(model=MODEL, messages=[])
        raise AssertionError("empty messages accepted")
    except openai.BadRequestError as e:
        assert "empty" in str(e), e
    try:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
        raise AssertionError("max_tokens 0 accepted")
    except openai.BadRequestError:
        pass


def test_anthropic_messages():
    m = an.messages.create(
        model=MODEL,
        system=SYSTEM,
        max_tokens=24,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": QUESTION}],
    )
    assert "Paris" in m.content[0].text, m
    assert m.usage.input_tokens > 0 and m.usage.output_tokens > 0, m.usage
    count = an.messages.count_tokens(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == m.usage.input_tokens, (count, m.usage)


def test_anthropic_stream():
    with an.messages.stream(
        model=MODEL,
        system=SYSTEM,
        max_tokens=24,
        extra_body={"temperature": 0},
        stop_sequences=["Paris"],
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert "Paris" not in text, text
    assert final.stop_reason == "stop_sequence", final
    assert final.usage.output_tokens > 0


def test_openai_sampling_parameters():
    """Values as clients send them, llama.cpp's extensions through extra_body, and a range error naming its field."""
    msgs = [{"role": "user", "content": QUESTION}]
    greedy = oa.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=12)
    for extra in ({"top_p": 0}, {"extra_body": {"min_p": 1}}, {"extra_body": {"top_k": 1}}):
        r = oa.chat.completions.create(model=MODEL, messages=msgs, temperature=2, seed=7, max_tokens=12, **extra)
        assert r.choices[0].message.content == greedy.choices[0].message.content, (extra, r)
    penalised = oa.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=12, frequency_penalty=2, presence_penalty=2
    )
    assert penalised.choices[0].message.content != greedy.choices[0].message.content, penalised
    try:
        oa.chat.completions.create(model=MODEL, messages=msgs, temperature=3, max_tokens=2)
        raise AssertionError("temperature 3 accepted")
    except openai.BadRequestError as e:
        assert "temperature" in str(e), e
    chunks = list(oa.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks), "usage without stream_options.include_usage"


def test_openai_logprobs():
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens, r
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content), content
    c = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=1)
    assert len(c.choices[0].logprobs.tokens) == 4, c


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_openai_tools_and_structured_output():
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    # One call: forced parallel calls let a small model repeat calls up to max_tokens (then finish_reason length).
    r = oa.chat.completions.create(
        model=MODEL,
        messages=msgs,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather", r
    import json

    assert isinstance(json.loads(call.function.arguments)["city"], str), call
    # The agent loop: the call and its result go back; the SDK sends content None for the assistant turn.
    msgs2 = msgs + [r.choices[0].message.model_dump(exclude_none=True)]
    msgs2.append({"role": "tool", "tool_call_id": call.id, "content": "21 C, clear"})
    r2 = oa.chat.completions.create(model=MODEL, messages=msgs2, tools=tools, tool_choice="none", max_tokens=16)
    assert r2.choices[0].message.content, r2
    s = oa.chat.completions.create(
        model=MODEL,
        messages=msgs,
        temperature=0,
        max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}},
    )
    assert isinstance(json.loads(s.choices[0].message.content)["city"], str), s


def test_anthropic_tool_use():
    m = an.messages.create(
        model=MODEL,
        max_tokens=80,
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    use = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(use) == 1 and use[0].name == "get_weather", m
    assert isinstance(use[0].input["city"], str), use


def test_anthropic_stop_sequence_and_system_blocks():
    msgs = [{"role": "user", "content": QUESTION}]
    m = an.messages.create(
        model=MODEL,
        system=SYSTEM,
        max_tokens=24,
        extra_body={"temperature": 0},
        stop_sequences=["never-generated", "Paris", "also-never"],
        messages=msgs,
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris", m
    blocks = an.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": SYSTEM}], messages=msgs)
    string = an.messages.count_tokens(model=MODEL, system=SYSTEM, messages=msgs)
    bare = an.messages.count_tokens(model=MODEL, messages=msgs)
    # Without a system message SmolLM2's template writes its own default one, so the count differs either way.
    assert blocks.input_tokens == string.input_tokens != bare.input_tokens, (blocks, string, bare)


def test_anthropic_errors():
    try:
        an.messages.create(model="claude-3", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError as e:
        assert "not served" in str(e), e
    try:
        an.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("max_tokens 0 accepted")
    except anthropic.BadRequestError:
        pass


def main():
    tests = [(n, f) for n, f in sorted(globals().items()) if n.startswith("test_") and callable(f)]
    failed = 0
    for name, f in tests:
        try:
            f()
            print(f"ok   {name}")
        except Exception as e:  # noqa: BLE001 - report every failure, then fail the run
            failed += 1
            print(f"FAIL {name}: {type(e).__name__}: {e}")
    print(f"{len(tests) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
