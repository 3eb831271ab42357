"""Thinking models and tool calls, on the tiny models of tests/thinking_models.py (Qwen3's real
tokenizer and chat template, random weights): reasoning split on token ids and kept apart,
switched off, held to a budget; stop strings and output formats on the answer only; prefix
reuse across thinking turns; tool calls through the engine and the official `openai` client
(tool_choice required / named / auto / none, streaming accumulated by the SDK's own helpers, a
call -> result -> answer loop); trimming that never cuts a call from its result; the logprobs
of a reply a stop string cuts (local and through a remote engine).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from thinking_models import qwen3_tiny, r1_tiny

from miniserve.core.config import Constraint, SamplingParams
from miniserve.engine.chat import ChatError, ChatOptions, trim_history
from miniserve.engine.decode import GenerationStats
from miniserve.engine.engine import Chunk, _Reply, start_engine
from miniserve.engine.reply import CLOSING, ReplyParts

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def qwen3():
    engine = start_engine(str(qwen3_tiny()))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def r1():
    engine = start_engine(str(r1_tiny()))
    yield engine
    engine.close()


def sampled(seed: int = 0, tokens: int = 40, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, top_p=1.0, top_k=0, seed=seed, max_new_tokens=tokens, **kw
    )


def collect(stream) -> dict:
    out = {"text": "", "reasoning": "", "deltas": [], "ids": [], "last": None}
    for chunk in stream:
        out["text"] += chunk.text
        out["reasoning"] += chunk.reasoning
        out["deltas"] += chunk.tool_calls
        out["ids"] += chunk.token_ids
        if chunk.done:
            out["last"] = chunk
    return out


def think_id(engine) -> int:
    return engine.tokenizer.convert_tokens_to_ids("<think>")


# -- reasoning -------------------------------------------------------------------------------


def test_r1_template_starts_inside_reasoning_and_the_budget_forces_the_close(r1):
    closing = r1.tokenizer("\n</think>\n\n", add_special_tokens=False)["input_ids"]
    for budget in (0, 1, 7):
        out = collect(r1.chat(HI, sampled(budget, 30), ChatOptions(reasoning_budget=budget)))
        stats = out["last"].stats
        assert stats.reasoning_tokens == budget
        assert stats.new_tokens <= 30  # max_tokens counts reasoning and answer
        # the ids: `budget` reasoning tokens, the closing tokens forced, then the answer
        assert out["ids"][budget : budget + len(closing)] == closing
        reasoning = r1.tokenizer.decode(out["ids"][:budget]).strip("\n")
        answer = r1.tokenizer.decode(out["ids"][budget + len(closing) :], skip_special_tokens=True)
        assert out["reasoning"] == reasoning
        assert out["text"] == answer.lstrip("\n") and out["text"]
        assert "</think>" not in out["text"] + out["reasoning"]


def test_qwen3_opens_reasoning_itself_and_thinking_off_bans_it(qwen3):
    forced = sampled(1, 24, logit_bias={think_id(qwen3): 100.0})
    on = collect(qwen3.chat(HI, forced, ChatOptions(reasoning_budget=5)))
    assert on["last"].stats.reasoning_tokens == 5 and on["reasoning"] and on["text"]
    for off in (
        ChatOptions(thinking=False, reasoning_budget=5),
        ChatOptions(template_kwargs={"enable_thinking": False}),
    ):
        got = collect(qwen3.chat(HI, forced, off))
        assert got["reasoning"] == "" and got["last"].stats.reasoning_tokens == 0
        assert got["ids"][0] != think_id(qwen3)  # later, the tag is only text in the answer
    prompt = qwen3.chat_prompt(HI, forced, ChatOptions(thinking=False))
    assert qwen3.tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")


def test_stop_strings_apply_to_the_answer_only(r1):
    first = collect(r1.chat(HI, sampled(5, 30), ChatOptions(reasoning_budget=8)))
    words = first["reasoning"].split()
    stop = max(words, key=len)  # text that is in the reasoning
    again = collect(r1.chat(HI, sampled(5, 30, stop=(stop,)), ChatOptions(reasoning_budget=8)))
    assert again["reasoning"] == first["reasoning"]
    assert again["last"].stats.reasoning_tokens == 8


def test_the_output_format_starts_after_the_reasoning(r1, qwen3):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "maxLength": 10}},
        "required": ["answer"],
    }
    fmt = Constraint("json_schema", json.dumps(schema))
    for engine in (r1, qwen3):  # R1 opens the reasoning; on Qwen3 the format forces <think>
        for seed in range(3):
            got = collect(
                engine.chat(HI, sampled(seed, 80, constraint=fmt), ChatOptions(reasoning_budget=4))
            )
            assert got["last"].stats.reasoning_tokens == 4 and got["reasoning"]
            jsonschema.validate(json.loads(got["text"]), schema)


def test_the_split_is_on_token_ids_and_utf8_safe(qwen3):
    """Scripted ids through the reply's parts: a multi-byte character split over two tokens
    just before the closing tag, and `</think>` written as plain text tokens (not the tag) in
    the reasoning: the split happens at the tag's id only, never inside a character."""
    tok = qwen3.tokenizer
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    plain_end = [tok.convert_tokens_to_ids(t) for t in ("</", "think", ">")]
    emoji = next(
        ids
        for text in ("𝔘", "ꙮ", "𓀀", "🜁", "🤔")
        if len(ids := tok(text, add_special_tokens=False)["input_ids"]) > 1
    )
    assert len(emoji) > 1 and all(i not in (think, end) for i in plain_end)
    body = tok(" hmm", add_special_tokens=False)["input_ids"]
    answer = tok("ok.", add_special_tokens=False)["input_ids"]
    ids = [think, *body, *plain_end, *emoji, end, *tok("\n\n")["input_ids"], *answer]
    plan = qwen3.reply_plan(HI, ChatOptions(), None)
    parts = ReplyParts(plan, qwen3.eos_ids)
    chunks: list = []
    stats = GenerationStats()
    reply = _Reply(tok, SamplingParams(), stats, chunks.append, parts=parts)
    for i in ids:
        parts.accept(i)
        reply.token(i)
    reply.finish()
    pieces = [c for c in chunks if isinstance(c, Chunk)]
    reasoning = "".join(c.reasoning for c in pieces)
    assert reasoning == tok.decode([*body, *plain_end, *emoji]).lstrip("\n")
    assert "\ufffd" not in "".join(c.reasoning for c in pieces)
    assert "".join(c.text for c in pieces) == "ok."
    assert sum(len(c.token_ids) for c in pieces) == len(ids)  # every id in some chunk


SAID = ["ok", ".", " Done", ",", " STOP", " now"]


@pytest.mark.parametrize(
    "words, stop, answer, kept",
    [
        (SAID, ", STOP", "ok. Done", 3),  # "," held back, then cut with " STOP"
        (SAID, "Don", "ok. ", 3),  # " Done" starts in the answer: its id stays
        (SAID, "ok", "", 0),  # the answer's first token: the tags before it stay
        # the second "a" lets the first out but is held back itself, then cut
        (["ok", "a", "a", "X", "a"], "aXa", "oka", 2),
    ],
)
def test_a_stop_string_leaves_out_the_ids_of_what_it_removed(qwen3, words, stop, answer, kept):
    """Scripted ids through the reply's parts with a stop string: the chunks carry the ids of
    the reasoning, the tags and the answer up to the cut, in order (the API's logprobs are
    theirs); the ids of the text the stop string removed go out in none."""
    tok = qwen3.tokenizer
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    head = [think, *tok(" hmm")["input_ids"], end, *tok("\n\n")["input_ids"]]
    ids = [i for w in words for i in tok(w)["input_ids"]]
    assert len(ids) == len(words)  # a token each
    parts = ReplyParts(qwen3.reply_plan(HI, ChatOptions(), None), qwen3.eos_ids)
    chunks: list = []
    reply = _Reply(tok, SamplingParams(stop=(stop,)), GenerationStats(), chunks.append, parts=parts)
    for i in [*head, *ids]:
        parts.accept(i)
        if not reply.token(i):
            break
    reply.finish()
    assert "".join(c.text for c in chunks) == answer
    assert [i for c in chunks for i in c.token_ids] == [*head, *ids[:kept]]


def test_a_stop_string_does_not_reach_across_a_tool_call(qwen3):
    """Scripted ids with tools: answer text held back in case it becomes a stop string goes
    out before a call that follows it, and the stop string is not matched across the call
    ("EN", a call, then "D" is no "END"); every id, the call's included, goes out in order."""
    tok = qwen3.tokenizer
    options = ChatOptions(tools=(TIME,), thinking=False)
    tools = qwen3.tool_plan(options)
    parts = ReplyParts(qwen3.reply_plan(HI, options, tools), qwen3.eos_ids)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    ids = [i for w in ("Sure EN", call, "D tail") for i in tok(w)["input_ids"]]
    chunks: list = []
    stop = SamplingParams(stop=("END",))
    reply = _Reply(
        tok, stop, GenerationStats(), chunks.append, parts=parts, tool_format=qwen3.tool_format
    )
    for i in ids:
        parts.accept(i)
        assert reply.token(i)
    reply.finish()
    assert "".join(c.text for c in chunks) == "Sure END tail"
    first_call = next(n for n, c in enumerate(chunks) if c.tool_calls)
    assert "".join(c.text for c in chunks[:first_call]) == "Sure EN"  # before the call
    assert [c.name for c in chunks[-1].calls] == ["get_time"]
    assert [i for c in chunks for i in c.token_ids] == ids


def test_a_call_given_back_as_text_is_cut_by_a_stop_string_with_its_ids(qwen3):
    """Scripted ids with tools: a call region that does not parse comes back as the answer's
    text; a stop string inside it cuts the text, and the chunks carry the ids of the tokens
    whose text starts before the cut only."""
    tok = qwen3.tokenizer
    options = ChatOptions(tools=(TIME,), thinking=False)
    parts = ReplyParts(qwen3.reply_plan(HI, options, qwen3.tool_plan(options)), qwen3.eos_ids)
    before, region = "Sure ", "<tool_call>\nnot json END more\n</tool_call>"
    head, call = tok(before)["input_ids"], tok(region)["input_ids"]
    chunks: list = []
    stop = SamplingParams(stop=("END",))
    reply = _Reply(
        tok, stop, GenerationStats(), chunks.append, parts=parts, tool_format=qwen3.tool_format
    )
    for i in [*head, *call]:
        parts.accept(i)
        assert reply.token(i)
    reply.finish()
    shown = before + region[: region.index("END")]
    assert "".join(c.text for c in chunks) == shown and not chunks[-1].calls
    starts = [len(tok.decode(call[:k], skip_special_tokens=False)) for k in range(len(call))]
    kept = sum(1 for at in starts if at < len(shown) - len(before))
    assert [i for c in chunks for i in c.token_ids] == [*head, *call[:kept]]
    assert kept < len(call)


def test_back_restores_the_parts_exactly(r1):
    """ReplyParts.rollback (the Step view's Back): taking back tokens and accepting them again
    gives the same kinds, counters and masks."""
    fmt = Constraint("json_object")
    plan = r1.reply_plan(HI, r1.chat_options(ChatOptions(reasoning_budget=3)), None)
    parts = r1.reply_matcher(SamplingParams(constraint=fmt), plan)
    got = collect(r1.chat(HI, sampled(2, 40, constraint=fmt), ChatOptions(reasoning_budget=3)))
    ids = got["ids"]
    masks = []
    for i in ids:
        mask = parts.allowed(r1.runner.config.vocab_size)
        masks.append(None if mask is None else mask.clone())
        parts.accept(i)
    kinds, done = list(parts.kinds), parts.done
    for back in (1, 5, len(ids) - 2, len(ids)):
        parts.rollback(back)
        for j, i in enumerate(ids[len(ids) - back :], len(ids) - back):
            mask = parts.allowed(r1.runner.config.vocab_size)
            assert (mask is None) == (masks[j] is None)
            assert mask is None or bool((mask == masks[j]).all())
            parts.accept(i)
        assert parts.kinds == kinds and parts.done == done


def test_prefix_reuse_across_thinking_turns_is_the_common_prefix(r1, qwen3):
    """The next turn drops the earlier reasoning (the template's rule): the cache is reused for
    exactly the tokens the two prompts share (the earlier prompt and reply it holds against
    the new prompt)."""
    json_answer = Constraint("json_object")  # on Qwen3 a format makes it think first
    for engine, params in ((r1, sampled(9, 24)), (qwen3, sampled(9, 40, constraint=json_answer))):
        options = ChatOptions(reasoning_budget=6)
        engine.prefix_cache.clear()
        question = [{"role": "system", "content": "You are terse. " * 6}, *HI]
        prompt1 = engine.chat_prompt(question, params, options)
        got = collect(engine.chat(question, params, options))
        assert got["last"].stats.reasoning_tokens == 6
        follow = [
            *question,
            {"role": "assistant", "content": got["text"], "reasoning_content": got["reasoning"]},
            {"role": "user", "content": "and then?"},
        ]
        prompt2 = engine.chat_prompt(follow, params, options)
        held = prompt1 + got["ids"]
        common = 0
        while common < min(len(held), len(prompt2)) and held[common] == prompt2[common]:
            common += 1
        assert common >= len(prompt1) - 4  # the first prompt, up to the assistant's turn
        second = collect(engine.chat(follow, params, options))
        assert second["last"].stats.reused_tokens == min(common, len(prompt2) - 1)
        assert got["reasoning"] not in engine.tokenizer.decode(prompt2)
        assert got["text"] in engine.tokenizer.decode(prompt2)


def test_assistant_prefill_continues_the_last_message(qwen3):
    messages = [*HI, {"role": "assistant", "content": "Sure, the answer is"}]
    prompt = qwen3.chat_prompt(messages, sampled(), ChatOptions(thinking=False))
    assert qwen3.tokenizer.decode(prompt).endswith("Sure, the answer is")
    got = collect(qwen3.chat(messages, sampled(0, 5), ChatOptions(thinking=False)))
    assert got["last"].stats.new_tokens == 5


# -- tool calls through the engine -------------------------------------------------------------


def call_text(call) -> tuple[str, dict]:
    return call.name, json.loads(call.arguments)


def test_required_calls_parse_and_follow_their_schemas_for_50_seeds(qwen3):
    """The target: tool_choice required on random weights, 50 seeds, every call parses and is
    valid against its function's parameters."""
    options = ChatOptions(
        tools=TOOLS, tool_choice="required", parallel_tool_calls=False, thinking=False
    )
    for seed in range(50):
        got = collect(qwen3.chat(HI, sampled(seed, 120), options))
        last = got["last"]
        assert last.stats.finish_reason == "tool_calls", (seed, got["text"])
        assert len(last.calls) == 1 and got["text"] == ""
        name, args = call_text(last.calls[0])
        jsonschema.validate(args, SCHEMAS[name])


def test_a_named_function_and_parallel_calls(qwen3):
    named = ChatOptions(tools=TOOLS, tool_choice="get_time", thinking=False)
    for seed in range(5):
        calls = collect(qwen3.chat(HI, sampled(seed, 200), named))["last"].calls
        assert calls and all(c.name == "get_time" for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS["get_time"])


def test_auto_triggers_the_call_grammar_and_none_bans_the_opener(qwen3):
    opener = qwen3.tokenizer.convert_tokens_to_ids("<tool_call>")
    bias = sampled(3, 120, logit_bias={opener: 100.0})
    auto = collect(
        qwen3.chat(HI, bias, ChatOptions(tools=TOOLS, parallel_tool_calls=False, thinking=False))
    )
    assert auto["last"].stats.finish_reason == "tool_calls"
    name, args = call_text(auto["last"].calls[0])
    jsonschema.validate(args, SCHEMAS[name])
    none = collect(
        qwen3.chat(
            HI,
            bias.replace(max_new_tokens=20),
            ChatOptions(tools=TOOLS, tool_choice="none", thinking=False),
        )
    )
    assert opener not in none["ids"] and not none["last"].calls
    # the tools are in the prompt either way
    prompt = qwen3.chat_prompt(HI, bias, ChatOptions(tools=TOOLS, tool_choice="none"))
    assert "get_weather" in qwen3.tokenizer.decode(prompt)


def test_a_call_max_tokens_cuts_is_the_same_streamed_and_whole(qwen3):
    """Calls cut short by max_tokens after their deltas went out: the reply's calls are the
    deltas joined (the cut one with its arguments so far), never given back again as text
    (a streaming client would get each call twice)."""
    opener = qwen3.tokenizer.convert_tokens_to_ids("<tool_call>")
    options = ChatOptions(tools=TOOLS, parallel_tool_calls=False, thinking=False)
    cut = 0
    for seed in range(3):
        full = collect(qwen3.chat(HI, sampled(seed, 120, logit_bias={opener: 100.0}), options))
        assert full["last"].stats.finish_reason == "tool_calls", seed
        # stop partway through the last call's arguments
        tokens = len(full["ids"]) - 3
        got = collect(qwen3.chat(HI, sampled(seed, tokens, logit_bias={opener: 100.0}), options))
        last = got["last"]
        assert last.stats.finish_reason == "length"
        joined = {}
        for d in got["deltas"]:
            call = joined.setdefault(d["index"], ["", ""])
            call[0] += (d.get("function") or {}).get("name") or ""
            call[1] += (d.get("function") or {}).get("arguments") or ""
        assert [[c.name, c.arguments] for c in last.calls] == [joined[i] for i in sorted(joined)]
        assert "<tool_call>" not in got["text"] and "{" not in got["text"], got["text"]
        try:
            json.loads(last.calls[-1].arguments)
        except ValueError:
            cut += 1  # its JSON ends where max_tokens cut it
    assert cut > 0


def test_tool_requests_the_model_cannot_meet_name_the_field(qwen3, engine):
    with pytest.raises(ChatError, match="does not take tools") as info:
        engine.chat(HI, sampled(), ChatOptions(tools=TOOLS))
    assert info.value.field == "tools"
    # with tool_choice "none" nothing is to be called: the plain reply, as without tools
    plain = engine.chat_prompt(HI, sampled(), ChatOptions())
    assert engine.chat_prompt(HI, sampled(), ChatOptions(tools=TOOLS, tool_choice="none")) == plain
    with pytest.raises(ChatError, match="not among 'tools'") as info:
        qwen3.chat(HI, sampled(), ChatOptions(tools=TOOLS, tool_choice="get_nothing"))
    assert info.value.field == "tool_choice"
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "string", "pattern": "(("}},
            },
        },
    }
    with pytest.raises(ChatError) as info:
        qwen3.chat(HI, sampled(), ChatOptions(tools=[bad], tool_choice="required"))
    assert info.value.field == "tools"


def test_earlier_calls_reach_a_model_without_tools_as_text(qwen3, engine):
    """A conversation with tool calls, sent to a model whose template cannot show them: each
    call is written into its message as JSON (name, arguments, id, and its text), as
    llama.cpp fills them in, not dropped; a template that shows calls gets them as they are."""
    call = tool_exchange(0)[1]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {**call, "content": "Let me look."},
        {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text = engine.tokenizer.decode(engine.chat_prompt(messages, sampled()))
    written = json.dumps(
        {
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Paris " * 5, "days": 1}, "id": "c0"}
            ],
            "content": "Let me look.",
        },
        indent=2,
    )
    assert written in text and "sunny" in text
    assert collect(engine.chat(messages, sampled(tokens=4)))["last"].stats.new_tokens >= 1
    native = qwen3.tokenizer.decode(qwen3.chat_prompt(messages, sampled()))
    assert "<tool_call>" in native and '"tool_calls"' not in native


def tool_exchange(i: int) -> list[dict]:
    call = {
        "id": f"c{i}",
        "type": "function",
        "function": {
            "name": "get_weather",
            "arguments": json.dumps({"city": "Paris " * 5, "days": 1}),
        },
    }
    return [
        {"role": "user", "content": f"question {i} " * 10},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": "sunny " * 15},
        {"role": "assistant", "content": "It is sunny. " * 3},
    ]


def test_trimming_never_separates_a_call_from_its_result(qwen3):
    from miniserve.engine.chat import check_messages

    history = [m for i in range(6) for m in tool_exchange(i)]
    messages = check_messages([{"role": "system", "content": "sys"}, *history, *HI])
    options = ChatOptions(tools=TOOLS)
    full = len(qwen3.chat_prompt(messages, sampled(), options))
    for context in range(full - 40, full - 600, -70):
        trimmed = trim_history(qwen3.tokenizer, messages, context, 10, options)
        kept = trimmed.messages
        assert trimmed.dropped and kept[0]["role"] == "system" and kept[1]["role"] == "user"
        for j, m in enumerate(kept):
            if m["role"] == "tool":  # its call is kept, just before the results
                k = j
                while kept[k]["role"] == "tool":
                    k -= 1
                ids = {c["id"] for c in kept[k].get("tool_calls", [])}
                assert m["tool_call_id"] in ids
        assert len(trimmed.prompt_ids) <= context - 10


# -- the API, through the official client -----------------------------------------------------


@pytest.fixture(scope="module")
def client(qwen3):
    import openai

    from miniserve.serve.in_thread import serve_in_thread

    with serve_in_thread(qwen3) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def r1_client(r1):
    import openai

    from miniserve.serve.in_thread import serve_in_thread

    with serve_in_thread(r1) as port:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)


def valid_calls(calls) -> list[tuple[str, dict]]:
    out = []
    for c in calls:
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        assert c.id and c.type == "function"
        out.append((c.function.name, args))
    return out


def test_the_client_gets_tool_calls_whole_and_streamed_alike(client):
    """Non-stream and stream (accumulated by the SDK's own stream helper) give the same calls
    for the same seed: a call split over deltas must join to exactly the whole reply's."""
    ask = dict(
        model="default",
        messages=HI,
        tools=TOOLS,
        seed=11,
        temperature=0.9,
        max_tokens=300,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = client.chat.completions.create(**ask, tool_choice=choice)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
        calls = valid_calls(message.tool_calls)
        with client.chat.completions.stream(**ask, tool_choice=choice) as stream:
            pieces = sum(
                1 for event in stream if event.type == "tool_calls.function.arguments.delta"
            )
            final = stream.get_final_completion()
        assert pieces > 1  # the arguments came in pieces
        streamed = final.choices[0].message
        assert final.choices[0].finish_reason == "tool_calls"
        assert valid_calls(streamed.tool_calls) == calls
        assert [c.function.arguments for c in streamed.tool_calls] == [
            c.function.arguments for c in message.tool_calls
        ]
        if isinstance(choice, dict):
            assert {name for name, _ in calls} == {"get_weather"}


def test_a_three_step_loop_call_result_answer(client):
    messages = [{"role": "user", "content": "weather in Paris?"}]
    first = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        seed=3,
        max_tokens=200,
        reasoning_effort="none",
    )
    call = first.choices[0].message.tool_calls[0]
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    assert messages[-1].get("content") is None  # content null beside tool_calls
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    answer = client.chat.completions.create(
        model="default",
        messages=messages,
        tools=TOOLS,
        seed=3,
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens


def test_reasoning_content_apart_in_both_modes_and_the_switches(r1_client, client, qwen3):
    ask = dict(model="default", messages=HI, seed=4, temperature=0.9, max_tokens=20)
    whole = r1_client.chat.completions.create(**ask, extra_body={"reasoning_budget": 5})
    msg = whole.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning and msg.content and reasoning not in msg.content
    assert whole.usage.completion_tokens_details.reasoning_tokens == 5
    thought, text = "", ""
    for chunk in r1_client.chat.completions.create(
        **ask, stream=True, extra_body={"reasoning_budget": 5}
    ):
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += (delta.model_extra or {}).get("reasoning_content") or ""
            text += delta.content or ""
    assert (thought, text) == (reasoning, msg.content)
    # off: reasoning_effort none, or the template's own switch; the bias cannot bring it back
    bias = {str(think_id(qwen3)): 100}
    for off in (
        {"reasoning_effort": "none"},
        {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    ):
        reply = client.chat.completions.create(**ask, logit_bias=bias, **off)
        assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
        assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    on = client.chat.completions.create(**ask, logit_bias=bias, extra_body={"reasoning_budget": 3})
    assert on.usage.completion_tokens_details.reasoning_tokens == 3
    assert on.choices[0].message.model_extra["reasoning_content"]


def logprob_text(entries) -> str:
    return b"".join(bytes(e.bytes) for e in entries).decode()


def a_stop_between_tokens(entries, answer: str, others: list[str]) -> str:
    """Two whole tokens of a reply's answer (past its first three characters) as a stop
    string: one that first comes in the answer where the first of them starts (the cut falls
    between tokens) and that no other answer holds."""
    texts = [bytes(e.bytes).decode() for e in entries]
    at = len(answer) - len("".join(texts))  # each token's place in the answer
    for text, following in zip(texts, texts[1:]):
        stop = text + following
        if at >= 3 and answer.find(stop) == at and not any(stop in o for o in others):
            return stop
        at += len(text)
    raise AssertionError(f"no stop string between two tokens of {answer!r}")


def streamed_parts(chunks) -> dict[int, tuple[str, str, list[str]]]:
    """Each choice's (reasoning, content, logprob tokens) as a stream gave them."""
    parts: dict[int, tuple[str, str, list[str]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning, content, tokens = parts.get(choice.index, ("", "", []))
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                tokens = tokens + [e.token for e in choice.logprobs.content]
            parts[choice.index] = (reasoning, content, tokens)
    return parts


def test_logprobs_stop_where_a_stop_string_cuts_the_answer(r1_client, client):
    """A reply split into reasoning and answer, and one asked with tools: the logprobs cover
    the tokens of the text returned -- the reasoning's with the tags between it and the answer
    (vLLM's cover every token generated) and the answer's up to the stop string -- never the
    stop string's, streamed or not, for each of n choices. Before, they held every token
    generated, the stop string's included."""
    ask = dict(model="default", messages=HI, temperature=0.9, seed=7, n=2, max_tokens=30)
    cases = (
        (r1_client, {"extra_body": {"reasoning_budget": 5}}, CLOSING),
        (
            client,
            {"tools": TOOLS, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
            "",
        ),
    )
    for api, extra, between in cases:
        ask_this = {**ask, **extra, "logprobs": True}
        full = api.chat.completions.create(**ask_this).choices
        answers = [c.message.content for c in full]
        stops = [
            a_stop_between_tokens(c.logprobs.content, a, answers[:i] + answers[i + 1 :])
            for i, (c, a) in enumerate(zip(full, answers))
        ]
        cut = api.chat.completions.create(**ask_this, stop=stops).choices
        streamed = streamed_parts(api.chat.completions.create(**ask_this, stop=stops, stream=True))
        for i, (whole, choice) in enumerate(zip(full, cut)):
            reasoning = (choice.message.model_extra or {}).get("reasoning_content") or ""
            content, entries = choice.message.content, choice.logprobs.content
            assert bool(reasoning) == bool(between)
            assert choice.finish_reason == "stop"
            assert content == answers[i][: answers[i].index(stops[i])]
            assert logprob_text(whole.logprobs.content) == reasoning + between + answers[i]
            assert logprob_text(entries) == reasoning + between + content
            assert stops[i] not in logprob_text(entries)[len(reasoning) :]
            tokens = [e.token for e in entries]
            assert tokens == [e.token for e in whole.logprobs.content][: len(tokens)]
            assert streamed[i] == (reasoning, content, tokens)


def test_a_remote_thinking_model_passes_its_logprobs_on_as_they_came(r1):
    """A RemoteEngine in front of the R1 server, served by this API: with a stop string, the
    logprobs it passes on are the server's, its reasoning's and tags' included, streamed or
    not. Before, the answer's written characters were counted against the reasoning's tokens
    too, and most of the entries were left out."""
    import openai

    from miniserve.models.registry import parse_spec
    from miniserve.models.remote import RemoteEngine
    from miniserve.serve.in_thread import serve_in_thread

    ask = dict(model="default", messages=HI, temperature=0.9, seed=7, max_tokens=30)
    ask.update(logprobs=True, extra_body={"reasoning_budget": 5})
    with serve_in_thread(r1) as port:
        there = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        full = there.chat.completions.create(**ask).choices[0]
        stop = a_stop_between_tokens(full.logprobs.content, full.message.content, [])
        direct = there.chat.completions.create(**ask, stop=[stop]).choices[0]
        tokens = [e.token for e in direct.logprobs.content]
        far = RemoteEngine(parse_spec(f"http://127.0.0.1:{port}/v1"))
        with serve_in_thread(far) as near:
            here = openai.OpenAI(base_url=f"http://127.0.0.1:{near}/v1", api_key="x", max_retries=0)
            whole = here.chat.completions.create(**ask, stop=[stop]).choices[0]
            streamed = streamed_parts(here.chat.completions.create(**ask, stop=[stop], stream=True))
    assert whole.message.content == direct.message.content
    assert [e.token for e in whole.logprobs.content] == tokens and len(tokens) > 8
    assert streamed[0][2] == tokens


def test_tools_on_a_model_whose_template_has_none_is_a_400_naming_it(app_server):
    import openai

    plain = openai.OpenAI(base_url=app_server.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model="default", messages=HI, tools=TOOLS, max_tokens=3)
    error = info.value.body
    assert "does not take tools" in error["message"] and error["param"] == "tools"


def test_a_remote_model_gets_the_tools_and_switches_as_they_came(qwen3):
    """A RemoteEngine in front of this server (a model served elsewhere): the tools, the
    choice and the template's switches are forwarded; the calls and the reasoning come back
    as they would from a model here."""
    from miniserve.models.registry import parse_spec
    from miniserve.models.remote import RemoteEngine
    from miniserve.serve.in_thread import serve_in_thread

    with serve_in_thread(qwen3) as port:
        far = RemoteEngine(parse_spec(f"http://127.0.0.1:{port}/v1"))
        options = ChatOptions(
            tools=TOOLS, tool_choice="get_weather", parallel_tool_calls=False, thinking=False
        )
        there = collect(far.chat(HI, sampled(6, 120), options))
        here = collect(qwen3.chat(HI, sampled(6, 120), options))
        assert [(c.name, c.arguments) for c in there["last"].calls] == [
            (c.name, c.arguments) for c in here["last"].calls
        ]
        assert there["last"].calls and there["last"].calls[0].name == "get_weather"
        budget = ChatOptions(reasoning_budget=4)
        bias = sampled(6, 12, constraint=Constraint("json_object"))
        there = collect(far.chat(HI, bias, budget))
        here = collect(qwen3.chat(HI, bias, budget))
        assert there["reasoning"] == here["reasoning"] and there["reasoning"]
