"""A request's answer in OpenAI's shapes, read from its jobs' events (``flows.events``).

A request asking for ``n`` choices runs ``n`` jobs (``flows.admission.admit_jobs``); each job's events
make one choice (``Choice``). ``Reply`` puts them together: one response (the id of choice 0, every
choice with its index, the usage summed over the choices, as each choice is billed as a request of
its own), or one stream whose chunks carry the index of the choice they extend. A choice that fails
fails the request: the other choices' jobs are stopped, and each job is charged for what it
produced (``flows.settlement``), as a single request is.

A streamed choice sends the tokens that arrived together in one chunk: a client (or a proxy)
reading slower than the tokens come gets fewer, larger chunks, never a backlog of one per token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpResponseBase, JsonResponse, StreamingHttpResponse

from marketplace.api import admission
from marketplace.api.errors import error_body
from marketplace.db import release_connections
from marketplace.flows import runner
from marketplace.flows.events import Subscription
from marketplace.jobs import idempotency, services, tools
from marketplace.jobs.errors import JobFailed
from marketplace.jobs.models import Job

log = logging.getLogger("swarm.api")
# While a job is silent, its record is checked this often for signs of life; the response gives up
# only when the job stopped making progress (jobs.services.stopped_answering), never on a clock of its own.
PROGRESS_CHECK_S = 5.0


class Choice:
    """One job's events, shaped as the choice ``index`` of a response or of its chunks."""

    def __init__(self, job: Job, index: int, kind: str, subscription: Subscription) -> None:
        self.job, self.index, self.kind = job, index, kind
        self.logprobs = job.params.get("logprobs")  # alternatives per token, or None: no log-probabilities
        self.tool_choice = job.params.get("tool_choice", "none")
        self.calls_tool = self.tool_choice != "none"  # the output is, or may be, function calls
        self.decides = bool(job.params.get("tool_decides"))  # the output opens with "Yes" (calls) or "No" (words)
        self._offset = 0  # a text completion's characters so far, for its logprobs' text_offset
        self.subscription = subscription
        self.ended = False  # its job's last event (done or error) was read
        self.cached_tokens = 0  # prompt tokens its stages held already (prefix reuse), once done

    async def batches(self) -> AsyncIterator[list[dict]]:
        """The job's events, in order, up to its last, in batches of those that arrived together
        (a job's last event ends its batch). A silent job's record is checked every
        PROGRESS_CHECK_S without cancelling the wait in flight."""
        waiting: asyncio.Future | None = None
        try:
            while True:
                if waiting is None:
                    waiting = asyncio.ensure_future(self.subscription.get())
                done, _ = await asyncio.wait({waiting}, timeout=PROGRESS_CHECK_S)
                if not done:
                    reason = await sync_to_async(services.stopped_answering)(self.job.pk)
                    await sync_to_async(release_connections)()
                    if reason is None:
                        continue
                    log.warning("job %s: %s", self.job.public_id, reason)
                    code = services.COORDINATOR_LOST if reason == services.COORDINATOR_GONE else "timeout"
                    batch = [{"type": "job.error", "code": code, "message": reason}]
                else:
                    got, waiting = waiting, None
                    try:
                        batch = [got.result()]
                    except Exception as exc:  # the events' channel's own (e.g. Redis) error
                        log.warning("job %s: no event: %r", self.job.public_id, exc)
                        batch = [{"type": "job.error", "code": "timeout", "message": "the job stopped answering"}]
                    while batch[-1]["type"] == "job.token" and (more := self.subscription.get_nowait()) is not None:
                        batch.append(more)
                if batch[-1]["type"] in ("job.done", "job.error"):
                    self.ended = True
                    admission.job_ended()
                yield batch
                if self.ended:
                    return
        finally:
            if waiting is not None:  # the response is over (or its client left): nothing more is read
                waiting.cancel()
                await asyncio.gather(waiting, return_exceptions=True)
            self.subscription.close()

    async def events(self) -> AsyncIterator[dict]:
        """The job's events, in order, up to its last."""
        async for batch in self.batches():
            for event in batch:
                yield event

    def _logprobs(self, tokens: Sequence[dict]) -> dict | None:
        """The ``logprobs`` object of a choice or chunk for the token events ``tokens``, in the
        endpoint's shape; None when the request asked for none."""
        if self.logprobs is None:
            return None
        if self.kind == "chat":

            def entry(text: str, logprob: float, raw: list[int] | None) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode()) if raw is None else raw}

            content = [
                entry(t["token"], t["logprob"], t.get("bytes"))
                | {"top_logprobs": [entry(a, b, None if len(alt) < 3 else alt[2]) for a, b, *alt in t["top_logprobs"]]}
                for t in tokens
            ]
            return {"content": content, "refusal": None}
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t["token"])
        return {
            "tokens": [t["token"] for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{alt[0]: alt[1] for alt in t["top_logprobs"]} for t in tokens],
            "text_offset": offsets,
        }

    async def whole(self) -> tuple[dict, int]:
        """The whole choice and its completion tokens; JobFailed when its job failed."""
        text, finish, completion, tokens = [], "stop", 0, []
        async for event in self.events():
            if event["type"] == "job.token":
                text.append(event["text"])
                if "logprob" in event:
                    tokens.append(event)
            elif event["type"] == "job.done":
                finish, completion = event["finish_reason"], event["completion_tokens"]
                self.cached_tokens = event.get("cached_tokens", 0)
            else:
                raise job_error(event)
        content = "".join(text)
        logprobs = self._logprobs(tokens)
        if self.kind != "chat":
            return {"index": self.index, "text": content, "logprobs": logprobs, "finish_reason": finish}, completion
        calls_follow = None
        if self.decides:
            calls_follow, content = tools.decided(content)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        callable_ = self.calls_tool and finish == "stop" and calls_follow is not False
        calls = tools.tool_calls_of(content) if callable_ else None
        if calls:
            message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
            finish = "tool_calls"
        return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": finish}, completion

    def chunk(self, text: str | None, finish: str | None, *, first: bool = False, tokens: Sequence[dict] = ()) -> dict:
        """The choice's entry in a streamed chunk."""
        logprobs = self._logprobs(tokens) if tokens else None
        if self.kind != "chat":
            return {"index": self.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    async def deltas(self) -> AsyncIterator[dict | int]:
        """The choice's chunk entries as its tokens arrive (those that arrived together in one),
        then its completion tokens (an int); JobFailed when its job failed."""
        tokens: list[dict] = []  # token events whose log-probabilities no chunk carried yet
        held: list[str] = []  # calls' text, sent as tool_calls once whole
        # Calls are held until whole. Under "auto" the output's first characters tell calls from
        # words, or, where the model decides first, its opening word, which is left out.
        holding, deciding = self.calls_tool and self.tool_choice != "auto", self.tool_choice == "auto"
        opening = ""  # a deciding model's first characters, until they hold its decision
        async for batch in self.batches():
            text = []
            for event in batch:
                if event["type"] != "job.token":
                    break
                if "logprob" in event:
                    tokens.append(event)
                text.append(event["text"])
            new = "".join(text)
            if deciding and self.decides and new:
                opening += new
                calls_follow, new = tools.decided(opening)
                if calls_follow is not None or len(opening) >= max(map(len, tools.DECISIONS)):
                    holding, deciding = bool(calls_follow), False
                    new = new if calls_follow is not None else opening
            elif deciding and new:
                holding, deciding = tools.may_be_a_call(new), False
            if new and holding:
                held.append(new)
            elif new and not deciding:
                yield self.chunk(new, None, tokens=tokens)
                tokens = []
            event = batch[-1]
            if event["type"] == "job.done":
                finish = event["finish_reason"]
                self.cached_tokens = event.get("cached_tokens", 0)
                calls = tools.tool_calls_of("".join(held)) if held and finish == "stop" else None
                if calls:
                    entry = self.chunk(None, None, tokens=tokens)
                    entry["delta"] = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                    yield entry
                    finish, tokens = "tool_calls", []
                elif held or (deciding and opening):  # cut short: the text as it is
                    yield self.chunk("".join(held) or opening, None, tokens=tokens)
                    tokens = []
                yield self.chunk(None, finish, tokens=tokens)
                yield event["completion_tokens"]
            elif event["type"] == "job.error":
                raise job_error(event)


class Reply:
    """A request's answer from the choices of its jobs (choice 0's id names the response)."""

    def __init__(
        self,
        jobs: Sequence[Job],
        subscriptions: Sequence[Subscription],
        kind: str,
        model: str,
        layer,
        *,
        idempotent: int | None = None,
    ) -> None:
        """``subscriptions``: each job's events; ``layer``: the channel layer, to stop jobs."""
        self.jobs, self.kind, self.model, self.layer = list(jobs), kind, model, layer
        self.idempotent = idempotent  # the request's IdempotentRequest: its answer is kept for retries
        self.choices = [
            Choice(job, i, kind, subscription)
            for i, (job, subscription) in enumerate(zip(jobs, subscriptions, strict=True))
        ]
        self.prompt_tokens = sum(job.prompt_tokens for job in jobs)  # each choice is billed its prompt
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
        # Charged like any other prompt token; the stages held them already from an earlier request.
        cached = sum(choice.cached_tokens for choice in self.choices)
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    def envelope(self, choices: list[dict]) -> dict:
        return {
            "id": self.jobs[0].public_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "system_fingerprint": None,
        }

    async def cancel_unfinished(self) -> None:
        """Stop the jobs whose choices have not ended (the client went away, or a choice failed)."""
        for choice in self.choices:
            if not choice.ended:
                await runner.request_cancel(self.layer, choice.job.public_id)

    def answer(self, choices: list[dict], completion_tokens: int) -> dict:
        """The whole (not streamed) response."""
        return self.envelope(choices) | {
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "usage": self.usage(completion_tokens),
        }

    async def _kept(self, answer: dict | None) -> None:
        """An idempotent request's end: its answer kept for retries, or (None) the key let go."""
        if self.idempotent is not None:
            if answer is None:
                await sync_to_async(idempotency.abandon)(self.idempotent)
            else:
                await sync_to_async(idempotency.complete)(self.idempotent, answer)

    async def whole(self) -> dict:
        """The whole response; JobFailed when a choice's job failed (the others are stopped)."""
        tasks = [asyncio.ensure_future(choice.whole()) for choice in self.choices]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.shield(self.cancel_unfinished())
            await asyncio.shield(self._kept(None))
            raise
        answer = self.answer([choice for choice, _ in done], sum(completion for _, completion in done))
        await self._kept(answer)
        return answer

    async def sse(self, include_usage: bool) -> AsyncIterator[bytes]:
        """The response as server-sent events: each choice's chunks as its tokens arrive."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(choice: Choice) -> None:
            try:
                async for item in choice.deltas():
                    await queue.put(item)
            except JobFailed as exc:
                await queue.put(exc)
            finally:
                await queue.put(None)  # this choice is over

        if self.kind == "chat":
            yield sse(self.envelope([choice.chunk(None, None, first=True) for choice in self.choices]))
        pumps = [asyncio.create_task(pump(choice)) for choice in self.choices]
        completion, running, answer, kept = 0, len(pumps), None, False
        built = [Built(self.kind, choice.logprobs is not None, choice.index) for choice in self.choices]
        try:
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, JobFailed):
                    yield sse(error_body(item))
                    break
                elif isinstance(item, int):
                    completion += item
                else:
                    built[item["index"]].add(item)
                    yield sse(self.envelope([item]))
            else:
                answer = self.answer([b.choice for b in built], completion)
                # Kept before the stream's end goes out: a client that read [DONE] and retries at
                # once (or closes the connection on it, as the SDK does) finds its answer kept.
                await asyncio.shield(self._kept(answer))
                kept = True
                if include_usage:
                    yield sse(self.envelope([]) | {"usage": self.usage(completion)})
            yield b"data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            # The client went away mid-stream, or a choice failed: stop the rest, keep what was done.
            await asyncio.shield(self.cancel_unfinished())
            if not kept:
                await asyncio.shield(self._kept(None))


class Built:
    """A streamed choice put back together as the whole response's choice, from its chunk entries."""

    def __init__(self, kind: str, logprobs: bool, index: int) -> None:
        self.kind = kind
        empty: dict[str, Any] | None
        if kind == "chat":
            empty = {"content": [], "refusal": None} if logprobs else None
            message = {"role": "assistant", "content": "", "refusal": None}
            self.choice: dict[str, Any] = {"index": index, "message": message, "logprobs": empty, "finish_reason": None}
        else:
            empty = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []} if logprobs else None
            self.choice = {"index": index, "text": "", "logprobs": empty, "finish_reason": None}

    def add(self, entry: dict) -> None:
        if entry["finish_reason"] is not None:
            self.choice["finish_reason"] = entry["finish_reason"]
        if entry["logprobs"] is not None and self.choice["logprobs"] is not None:
            for name, values in entry["logprobs"].items():
                if isinstance(values, list):
                    self.choice["logprobs"][name].extend(values)
        if self.kind != "chat":
            self.choice["text"] += entry["text"]
            return
        message, delta = self.choice["message"], entry["delta"]
        if "tool_calls" in delta:
            message["content"] = None
            message["tool_calls"] = [{k: v for k, v in call.items() if k != "index"} for call in delta["tool_calls"]]
        elif delta.get("content"):
            message["content"] += delta["content"]


def replayed(answer: dict, stream: bool, include_usage: bool) -> HttpResponseBase:
    """A kept answer sent again: as it was, or as a stream of one chunk per choice then its end."""
    if not stream:
        return JsonResponse(answer)
    chat = answer["object"] == "chat.completion"
    envelope = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint")}
    envelope["object"] = "chat.completion.chunk" if chat else "text_completion"

    async def events() -> AsyncIterator[bytes]:
        if chat:
            role = [{"index": c["index"], "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for c in answer["choices"]]  # fmt: skip
            yield sse(envelope | {"choices": role})
        for c in answer["choices"]:
            if chat:
                message = c["message"]
                delta = (
                    {"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]}
                    if message.get("tool_calls")
                    else {"content": message["content"]}
                )
                body = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"], "finish_reason": None}
                end = {"index": c["index"], "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"]}
            else:
                body = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"], "finish_reason": None}
                end = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
            yield sse(envelope | {"choices": [body]})
            yield sse(envelope | {"choices": [end]})
        if include_usage:
            yield sse(envelope | {"choices": [], "usage": answer["usage"]})
        yield b"data: [DONE]\n\n"

    return EventStream(events())


class EventStream(StreamingHttpResponse):
    """Server-sent events from an async generator, closed as soon as the response stops: its end,
    or its client gone (the SDK closes the connection on [DONE]; a client may leave mid-stream).

    Django iterates an async stream through wrappers of its own that do not close what they wrap,
    and closes only the outermost: the generator (and what wraps it, the metrics' timer) would be
    left to the garbage collector, and with it the stop of a left request's jobs and the end of its
    Idempotency-Key. Here the content is iterated as it is set (each wrapper set on it closes what it
    wraps), and closed in the same task that sent it."""

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, content_type="text/event-stream")
        self["Cache-Control"] = "no-cache"

    @property
    def streaming_content(self) -> AsyncIterator[bytes]:  # type: ignore[override]
        return self._iterator  # type: ignore[attr-defined]  # bytes already: Django's wrapper would only re-encode them

    @streaming_content.setter
    def streaming_content(self, value: AsyncIterator[bytes]) -> None:
        self._set_streaming_content(value)  # type: ignore[attr-defined]

    async def __aiter__(self) -> AsyncIterator[bytes]:
        content = self._iterator  # type: ignore[attr-defined]
        try:
            async for part in content:
                yield part
        finally:
            await content.aclose()


def job_error(event: dict) -> JobFailed:
    return JobFailed(f"The job failed: {event.get('message')}", code=event.get("code", "job_failed"))


def sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()
