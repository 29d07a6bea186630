"""A model's own chat template (Jinja), rendered as transformers' ``apply_chat_template`` renders
it: a sandboxed environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``), the globals ``raise_exception``, ``strftime_now``, ``namespace``, a ``tojson``
that does not escape HTML, and the special tokens (``bos_token``, ``eos_token``, ...) as
variables. There is no default system turn: what the template adds, it adds.

`ChatTemplate.render` also says where each message's content lies in the text
(`RenderedChat.contents`), so that content can be encoded as text while the template's own
control tokens stay control tokens (`hal.server.openai_schema.encode_chat`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime

from hal.errors import HalError

# private-use characters no tokenizer merges with anything else: a message's content while rendering
_OPEN, _CLOSE = "\ue000", "\ue001"


@dataclass(frozen=True)
class RenderedChat:
    """A conversation rendered for the model: ``text``, and where each message's content lies in
    it (``contents``: ``(start, end)`` character spans, in order; None where the template
    transforms content, so its place is not known)."""

    text: str
    contents: tuple[tuple[int, int], ...] | None
    message_contents: tuple[str, ...] = ()   # each message's content as given


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):   # no dunder attributes (as transformers')
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}: underscore names are refused")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=Namespace)
    return env


class ChatTemplate:
    """``source`` (Jinja) compiled once; ``specials``: the template's variables for the special
    tokens (``{"bos_token": "<s>", "eos_token": "</s>"}``); ``origin`` names where it came from
    (errors name it)."""

    def __init__(self, source: str, specials: dict[str, str] | None = None, origin: str = "chat template"):
        import jinja2
        if not isinstance(source, str) or not source.strip():
            raise HalError(f"{origin}: expected a Jinja chat template, got {source!r:.80}")
        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise HalError(f"{origin}: expected a Jinja chat template, got one that does not compile: {e}") from None
        self.source, self.specials, self.origin = source, dict(specials or {}), origin

    def render_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` (plain dicts: ``role``, ``content``, ...)."""
        import jinja2
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.specials)
        except jinja2.exceptions.TemplateError as e:   # raise_exception, or the sandbox refusing
            raise HalError(f"messages: expected a conversation this model's chat template accepts, got one it "
                           f"refuses: {e}", arg="messages") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise HalError(f"messages: expected a conversation this model's chat template can render, got one "
                           f"where it fails: {type(e).__name__}: {e}", arg="messages") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> RenderedChat:
        """The text, and each message's content span: the template is rendered with a marker in
        place of each content, and again with the contents; where putting the contents in the
        markers' places gives the second text exactly, the spans are known."""
        text = self.render_text(messages, add_generation_prompt)
        given = tuple(m["content"] for m in messages if isinstance(m.get("content"), str))
        marked = [{**m, "content": f"{_OPEN}{i}{_CLOSE}"} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        try:
            skeleton = self.render_text(marked, add_generation_prompt)
        except HalError:   # the template reads the content (a check on it): the spans stay unknown
            return RenderedChat(text, None, given)
        out, spans, at = [], [], 0
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str):
                continue
            mark = f"{_OPEN}{i}{_CLOSE}"
            where = skeleton.find(mark, at)
            if where < 0 or skeleton.count(mark) != 1:
                return RenderedChat(text, None, given)
            out.append(skeleton[at:where])
            start = sum(map(len, out))
            out.append(m["content"])
            spans.append((start, start + len(m["content"])))
            at = where + len(mark)
        out.append(skeleton[at:])
        if "".join(out) != text:
            return RenderedChat(text, None, given)
        return RenderedChat(text, tuple(spans), given)
