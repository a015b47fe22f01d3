"""A model's chat template rendered as transformers renders it, bounded: the template comes from a
model file, so it is untrusted input. Jinja's immutable sandbox (as transformers uses), plus bounds
on time, output size and what one expression may build; every failure is one UserError that names
the template's origin.

    template = compile_template(source, origin="model.gguf")
    prompt = render(template, {"messages": [...], "add_generation_prompt": True}, "model.gguf")
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from caramba.errors import UserError


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in HF;
    when rendering a prompt it only needs to pass its body through."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise _TemplateRejected(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters (<, >, &), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# Bounds on rendering a chat template (it comes from a model file, so it is untrusted input): a
# real template renders a conversation in milliseconds into a few KiB.
TEMPLATE_SECONDS = 2.0          # wall time for one render
TEMPLATE_MAX_CHARS = 4 << 20    # characters of output, and of any string or list it builds
TEMPLATE_MAX_POWER = 1 << 12    # largest exponent `**` may take


class _TemplateLimit(Exception):
    """A chat template went past one of the bounds above."""


class _TemplateRejected(Exception):
    """raise_exception() in the template: a conversation it refuses."""


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, plus bounds on what one expression may build: `'a' * 10**9`,
    `2 ** 10**9` and `'%99999999d' % 1` are refused before they allocate."""

    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, int) and abs(right) > TEMPLATE_MAX_POWER:
            raise _TemplateLimit(f"an exponent of {right}")
        if operator == "%" and isinstance(left, str):  # printf widths and precisions: '%999999999d'
            for number in re.findall(r"%[-#0 +]*(\d*)(?:\.(\d*))?", left):
                if any(n and int(n) > TEMPLATE_MAX_CHARS for n in number):
                    raise _TemplateLimit(f"a format width in {left[:40]!r}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > TEMPLATE_MAX_CHARS:
                    raise _TemplateLimit(f"a sequence of {len(seq)} x {n} items")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str) and len(result) > TEMPLATE_MAX_CHARS:  # e.g. a huge % width (built once)
            raise _TemplateLimit(f"a string of {len(result)} characters")
        return result

    def call(self, __context, __obj, *args, **kwargs):
        _check_call_size(__obj, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)


def _check_call_size(function, args, kwargs) -> None:
    """Refuse calls that would build a huge string: a width (`center(10**9)`, `ljust`, `indent`)
    or a replacement (`s.replace('a', s)`) past TEMPLATE_MAX_CHARS."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > TEMPLATE_MAX_CHARS:
            raise _TemplateLimit(f"an argument of {value}")
    if getattr(function, "__name__", None) in ("replace", "do_replace"):
        text = getattr(function, "__self__", None)
        if not isinstance(text, str):  # the `replace` filter: ([eval context,] value, old, new)
            strings = [i for i, a in enumerate(args) if isinstance(a, str)]
            text, args = (args[strings[0]], args[strings[0] + 1:]) if strings else (None, ())
        if isinstance(text, str) and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            grows = len(args[1]) - len(args[0])
            if len(text) + max(grows, 0) * (text.count(args[0]) if args[0] else len(text) + 1) > TEMPLATE_MAX_CHARS:
                raise _TemplateLimit("a replace() result past the size bound")


def _bounded_filter(function):
    @functools.wraps(function)
    def bounded(*args, **kwargs):
        _check_call_size(function, args, kwargs)
        return function(*args, **kwargs)
    return bounded


def _refuse_include(name: str):
    raise _TemplateLimit(f"{{% include/import/extends {name!r} %}}: a chat template must be self-contained")


def render(template: jinja2.Template, variables: dict, origin: str) -> str:
    """Render with a deadline (checked on every template line, so loops that print nothing stop
    too), an output cap, and every failure as one UserError naming the template."""
    deadline = time.monotonic() + TEMPLATE_SECONDS
    filename = template.environment.template_filename

    def on_line(frame, event, arg):
        if time.monotonic() > deadline:
            raise _TemplateLimit(f"rendering took over {TEMPLATE_SECONDS:g} s")
        return on_line

    def on_call(frame, event, arg):  # trace only the template's own compiled code
        return on_line if frame.f_code.co_filename == filename else None

    previous = sys.gettrace()
    chunks, size = [], 0
    try:
        if previous is None:  # under a debugger or coverage keep their tracer; the other bounds still hold
            sys.settrace(on_call)
        for chunk in template.generate(**variables):
            size += len(chunk)
            if size > TEMPLATE_MAX_CHARS:
                raise _TemplateLimit(f"output past {TEMPLATE_MAX_CHARS:,} characters")
            chunks.append(chunk)
    except _TemplateRejected as e:
        raise UserError(f"chat template of {origin} rejected the messages: {e}") from None
    except _TemplateLimit as e:
        raise UserError(f"chat template of {origin} refused: {e} (chat templates are bounded in time and size)") from None
    except jinja2.TemplateError as e:
        raise UserError(f"chat template of {origin} failed: {e}") from None
    except Exception as e:  # a division by zero, a bad filter argument, recursion...
        raise UserError(f"chat template of {origin} failed: {type(e).__name__}: {e}") from None
    finally:
        if previous is None:
            sys.settrace(None)
    return "".join(chunks)


def compile_template(source: str, origin: str) -> jinja2.Template:
    # Same environment as transformers: templates come from model files, so they run sandboxed.
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
        loader=jinja2.FunctionLoader(_refuse_include),
    )
    env.template_filename = f"<chat template {id(env)}>"
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        code = env.compile(source, filename=env.template_filename)
        return env.template_class.from_code(env, code, env.make_globals(None))
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"chat template of {origin} is not valid Jinja (line {e.lineno}: {e.message})") from None
