"""The front end without workers: input checks (zpp/frontend/inputs.py) and the output processor
(zpp/frontend/output_processor.py) fed hand-made core deltas, with the real SmolLM2 tokenizer."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from zpp.transport import core_messages as cm
from zpp.errors import RequestError
from zpp.frontend.inputs import InputProcessor
from zpp.frontend.output_processor import OutputProcessor, StreamDeltas
from zpp.outputs import Logprob
from zpp.sampling_params import SamplingParams
from zpp.transport.messages import PromptLogprobsOutput, TokenLogprobs


def test_validate_resolves_max_tokens_and_names_the_field():
    ip = InputProcessor(None, vocab_size=100, max_model_len=64, num_kv_blocks=3, block_size=16)
    # a KV cache of 48 tokens, below max_model_len: the default fills the cache, not max_model_len
    assert ip.validate([1, 2, 3], SamplingParams(max_tokens=None)) == 45
    with pytest.raises(RequestError, match="needs 4 KV blocks"):  # an explicit max_tokens is checked
        ip.validate([1, 2, 3], SamplingParams(max_tokens=61))
    with pytest.raises(RequestError, match="the KV cache holds only 3 blocks of 16") as e:
        ip.validate([1] * 48, SamplingParams(max_tokens=None))
    assert e.value.param == "prompt"
    ip.num_kv_blocks = 10
    assert ip.validate([1, 2, 3], SamplingParams(max_tokens=None)) == 61
    assert ip.validate([1, 2, 3], SamplingParams(max_tokens=5)) == 5
    cases = [([], SamplingParams(), "prompt", "empty"),
             ([1] * 64, SamplingParams(), "prompt", "max_model_len is 64"),
             ([1, 100], SamplingParams(), "prompt", "outside the vocabulary"),
             ([1, 2], SamplingParams(max_tokens=63), "max_tokens", "exceeds max_model_len 64")]
    for ids, sp, param, words in cases:
        with pytest.raises(RequestError, match=words) as e:
            ip.validate(ids, sp)
        assert e.value.param == param
    ip.num_kv_blocks = 2
    with pytest.raises(RequestError, match="needs 3 KV blocks") as e:
        ip.validate([1] * 20, SamplingParams(max_tokens=20))
    assert e.value.param == "max_tokens"
    with pytest.raises(RequestError, match="no tokenizer"):
        ip.tokenize_prompt("hello")


def _processor(tokenizer):
    aborted: list[str] = []
    return OutputProcessor(tokenizer, aborted.extend), aborted


def _step(*deltas) -> cm.StepOutputs:
    # Through msgpack and back, as the deltas travel from the core process.
    enc = msgspec.msgpack.encode(cm.StepOutputs(list(deltas), cm.EngineStats()))
    return msgspec.msgpack.Decoder(cm.FromCore).decode(enc)


def _drain(group):
    items = []
    while not group.queue.empty():
        items.append(group.queue.get_nowait())
    return items


def test_deltas_become_cumulative_outputs_and_a_stop_string_aborts_in_core(tokenizer):
    async def run():
        op, aborted = _processor(tokenizer)
        prompt = tokenizer.encode("Say hi")
        sp = SamplingParams(max_tokens=20, stop=["END"])
        g = op.new_group("r", "Say hi", prompt, sp, ["r"], stream=True)
        op.add(g)
        words = tokenizer.encode(" hello world END more")
        outs = []
        for t in words:
            op.process(_step(cm.SeqDelta("r", t)))
            outs += _drain(g)
            if outs and outs[-1].finished:
                break
        final = outs[-1]
        assert final.finished and final.outputs[0].finish_reason == "stop"
        assert final.outputs[0].stop_reason == "END"
        assert final.outputs[0].text == " hello world "
        assert aborted == ["r"], "the core must be told to stop the sequence"
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "text taken back"
        # A delta the core computed before the abort reached it is dropped.
        op.process(_step(cm.SeqDelta("r", words[0])))
        assert _drain(g) == [] and "r" not in op.groups
    asyncio.run(run())


def test_eos_text_hidden_n_fanout_logprobs_and_prompt_logprobs(tokenizer):
    async def run():
        op, aborted = _processor(tokenizer)
        prompt = tokenizer.encode("a b c")
        sp = SamplingParams(max_tokens=3, n=2, logprobs=1, prompt_logprobs=0)
        g = op.new_group("q", None, prompt, sp, ["q#0", "q#1"], stream=False)
        op.add(g)
        lp = lambda t, v: TokenLogprobs(t, v, 1, [t], [v])  # noqa: E731
        other = tokenizer.encode(" there")[0]
        plp = PromptLogprobsOutput(0, 1, [lp(t, -0.5) for t in prompt[1:]])
        eos = tokenizer.eos_token_id
        hi = tokenizer.encode(" hi")[0]
        op.process(_step(cm.SeqDelta("q#0", prompt_logprobs=None), cm.SeqDelta("q#1", hi, lp(hi, -1.0), prompt_logprobs=plp)))
        # the sampled token outside the top-1 (rank 3), the top-1 another token
        op.process(_step(cm.SeqDelta("q#1", eos, TokenLogprobs(eos, -0.25, 3, [other], [-0.1]),
                                     finish_reason="stop")))
        assert _drain(g) == [], "stream=False publishes only the final output"
        op.process(_step(cm.SeqDelta("q#0", hi, lp(hi, -2.0)), ))
        op.process(_step(cm.SeqDelta("q#0", hi, lp(hi, -2.0), finish_reason="length")))
        [final] = _drain(g)
        a, b = final.outputs
        assert a.token_ids == [hi, hi] and a.finish_reason == "length" and a.cumulative_logprob == -4.0
        assert b.token_ids == [hi, eos] and b.finish_reason == "stop" and b.text == " hi", "EOS adds no text"
        text = lambda t: tokenizer.decode([t])  # noqa: E731
        assert b.logprobs == [{hi: Logprob(-1.0, 1, " hi")},
                              {eos: Logprob(-0.25, 3, text(eos)), other: Logprob(-0.1, 1, " there")}]
        assert list(b.logprobs[1]) == [eos, other], "the sampled token first"
        assert final.prompt_logprobs == [None] + [{t: Logprob(-0.5, 1, text(t))} for t in prompt[1:]]
        assert aborted == []
    asyncio.run(run())


def _stream_chunks(op, g, feed):
    """Feed ``feed`` (a list of steps, each a list of SeqDelta) one step at a time and cut the
    published outputs into stream deltas as the endpoints do; return {choice: [ChoiceDelta]}."""
    sd, chunks = StreamDeltas(), {}
    for deltas in feed:
        op.process(_step(*deltas))
        for out in _drain(g):
            for key, d in sd.deltas(out.outputs):
                if d.token_ids or d.finish_reason is not None:
                    chunks.setdefault(key, []).append(d)
                    sd.sent(key, d)
    return chunks


def test_stream_deltas_carry_whole_tokens_with_stop_strings_and_logprobs(tokenizer):
    """Issue 38: a held-back stop-string prefix used to split a token across two chunks, so a
    chunk's logprobs did not match its text. Every chunk now carries whole tokens: its text is its
    tokens' text and its logprobs are theirs; the last chunk of a stop-string stop ends at the stop
    string, its last token (which goes past it) reported in full, as vLLM does. n=2: one choice
    stopped mid-token by a stop string, one ending by length on split multi-byte characters."""
    async def run():
        op, aborted = _processor(tokenizer)
        stop = ["al of Germ", "xyz"]  # "al" ends " capital": held twice, released once, then matched
        text0 = " The capital of France is Paris. The capital of Germany is Berlin."
        text1 = " Hi 你好 and 😀 ok"
        ids0, ids1 = tokenizer.encode(text0), tokenizer.encode(text1)
        n0 = len(tokenizer.encode(" The capital of France is Paris. The capital of Germany"))
        sp = SamplingParams(max_tokens=len(ids1), n=2, logprobs=1, stop=stop)
        g = op.new_group("s", None, tokenizer.encode("Say"), sp, ["s#0", "s#1"], stream=True)
        op.add(g)
        lp = lambda t: TokenLogprobs(t, -0.5, 1, [t], [-0.5])  # noqa: E731
        feed = []
        for j in range(max(len(ids0), len(ids1))):
            step = [cm.SeqDelta("s#0", ids0[j], lp(ids0[j]))] if j < len(ids0) else []
            if j < len(ids1):
                step.append(cm.SeqDelta("s#1", ids1[j], lp(ids1[j]),
                                        finish_reason="length" if j == len(ids1) - 1 else None))
            feed.append(step)
        chunks = _stream_chunks(op, g, feed)
        assert aborted == ["s#0"]
        for key, ds in chunks.items():
            assert ds[-1].finish_reason is not None and all(d.finish_reason is None for d in ds[:-1])
            for d in ds:
                assert [next(iter(e)) for e in d.logprobs] == d.token_ids, "a chunk's logprobs are its tokens"
                if d is not ds[-1] or key == 1:
                    assert d.text == tokenizer.decode(d.token_ids), (key, d.text, d.token_ids)
            assert "".join(d.text for d in ds) == ds[-1].output.text
            assert sum((d.token_ids for d in ds), []) == ds[-1].output.token_ids
        c0, c1 = chunks[0][-1].output, chunks[1][-1].output
        assert c0.text == " The capital of France is Paris. The capit" and c0.stop_reason == "al of Germ"
        assert c0.token_ids == ids0[:n0], "the token the stop string ended in is reported"
        last = chunks[0][-1]
        assert tokenizer.decode(last.token_ids).startswith(last.text)
        assert tokenizer.decode(last.token_ids)[len(last.text):].startswith("al of Germ")
        assert not any(d.text.endswith(" capit") or d.text.startswith("al") for d in chunks[0][:-1])
        assert c1.text == text1 and c1.token_ids == ids1 and c1.finish_reason == "length"
        assert c1.cumulative_logprob == -0.5 * len(ids1)
        assert all("\ufffd" not in d.text for d in chunks[1])
    asyncio.run(run())


def test_abort_returns_only_live_sequences_and_end_all_reaches_streams(tokenizer):
    async def run():
        op, _ = _processor(tokenizer)
        g = op.new_group("x", None, [1, 2], SamplingParams(max_tokens=4, n=2), ["x#0", "x#1"], stream=True)
        op.add(g)
        op.process(_step(cm.SeqDelta("x#0", 5, finish_reason="length")))
        assert op.abort("x") == ["x#1"]
        g2 = op.new_group("y", None, [1, 2], SamplingParams(max_tokens=4), ["y"], stream=True)
        op.add(g2)
        op.end_all(RuntimeError("gone"))
        assert isinstance(_drain(g2)[-1], RuntimeError)
    asyncio.run(run())


class _StandInStages:
    """A StageExecutor without workers: every sampled chunk gets token ``7 + its position``;
    ``die(reason)`` makes the next ``next_result`` raise, as a worker death does."""

    def __init__(self):
        from zpp.trace import Trace
        self.num_blocks, self.eos_token_ids, self.stage_busy_s, self.trace = 64, {0}, [0.0], Trace("engine")
        self.stage_idle_s = [0.0]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.sent = 0

    def send(self, batch, result_fields=None):
        from zpp.transport import messages as m
        self.sent += 1
        c = m.BatchColumns(batch)
        self.queue.put_nowait(m.StepResult(batch.batch_id, m.pack_int32((7 + c.starts + c.num_tokens)[c.sample])))

    async def next_result(self):
        item = await self.queue.get()
        if isinstance(item, Exception):
            self.queue.put_nowait(item)
            raise item
        return item

    def interrupt(self):
        self.queue.put_nowait(None)

    def die(self, reason):
        from zpp.errors import WorkerDiedError
        self.queue.put_nowait(WorkerDiedError(reason))

    def shutdown(self):
        pass


def test_engine_core_on_a_stand_in_executor_and_its_one_death_channel(demo_model):
    """The core drives any StageExecutor: requests added while it waits wake it (interrupt), each
    step's deltas carry the sampled tokens, and a death raised by next_result reaches on_dead once
    with its reason (the one death channel); the loop then stops sending."""
    from zpp.config import EngineConfig, ModelConfig, SchedulerConfig
    from zpp.engine.core import EngineCore

    async def main():
        stages = _StandInStages()
        config = EngineConfig(model=ModelConfig(model=demo_model), scheduler=SchedulerConfig(max_num_batched_tokens=64))
        outs, deaths = {}, []
        core = EngineCore(config, stages, lambda so: [outs.setdefault(d.req_id, []).append(d.token_id)
                                                       for d in so.deltas], deaths.append)
        core._loop_task = asyncio.create_task(core._run())
        await asyncio.sleep(0.05)  # idle: waiting in next_result
        core.add_requests([cm.CoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), 3)])
        for _ in range(100):
            if len(outs.get("a", [])) == 3:
                break
            await asyncio.sleep(0.01)
        assert outs["a"] == [7 + 3, 7 + 4, 7 + 5]
        sent = stages.sent
        stages.die("stage 1 died: test")
        await asyncio.wait_for(core._loop_task, 2)
        assert deaths == ["stage 1 died: test"] and core.dead == "stage 1 died: test"
        core.add_requests([cm.CoreRequest("b", [1, 2], SamplingParams(max_tokens=2), 2)])
        await asyncio.sleep(0.05)
        assert stages.sent == sent  # nothing sent after the death
    asyncio.run(main())


def test_template_ignoring_tools_shows_earlier_calls_in_their_assistant_turn(tokenizer):
    """SmolLM2's template renders neither ``tools`` nor ``tool_calls``: zpp describes the tools in
    the system message and must then also write the assistant's earlier call into its turn, in the
    tool-call parser's own format (each parser reads back what it wrote), or a call -> result ->
    answer conversation shows a result with no call (the model then repeated zpp's tool text)."""
    from zpp.frontend.inputs import ChatOptions
    from zpp.parsers.tool import TOOL_PARSERS
    ip = InputProcessor(tokenizer, 49152, 8192, 512, 16)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C sunny"}]
    assert "<|im_start|>assistant\n<|im_end|>" in ip.render_chat(msgs, ChatOptions(tools=tools, tools_system_text="T"))
    for cls in TOOL_PARSERS.values():
        parser = cls()
        text = ip.render_chat(msgs, ChatOptions(tools=tools, tools_system_text="T", format_tool_calls=parser.format_calls))
        written = parser.format_calls([("get_weather", '{"city": "Paris"}')])
        assert f"<|im_start|>assistant\n{written}<|im_end|>\n<|im_start|>tool\n22C sunny" in text, cls.name
        assert parser.extract(written, {"get_weather"})[1] == [("get_weather", '{"city": "Paris"}')]
    # content before the call stays; a template that writes tool_calls itself is left to do so
    msgs[1]["content"] = "Let me look."
    hermes = TOOL_PARSERS["hermes"]()
    text = ip.render_chat(msgs, ChatOptions(tools=tools, tools_system_text="T", format_tool_calls=hermes.format_calls))
    assert "assistant\nLet me look.\n<tool_call>{\"name\": \"get_weather\"" in text
    own = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
           "[{{ c.function.name }}]{% endfor %}\n{% endfor %}")
    text = ip.render_chat(msgs, ChatOptions(template=own, tools=tools, tools_system_text="T",
                                            format_tool_calls=hermes.format_calls))
    assert "assistant:Let me look.[get_weather]" in text and "<tool_call>" not in text
