"""Tools in the model's own format (agentic_grpo.py). A tool is a typed, documented Python function: its JSON schema
(transformers' get_json_schema) reaches the prompt through the chat template. A turn's calls are parsed by vLLM's
own tool parsers (--tool_parser takes the names `vllm serve --tool-call-parser` does, so a model serves as it
trained); the tiny world's calculator syntax, "<<23 + 11>>", is registered as one more. The calls run in threads,
with a timeout, while the engine steps the other episodes. The replies are the chat template's tool messages and the
next assistant header (with no chat template: the tiny world's " = 34\\n"), encoded on their own and appended as ids:
`turn_format` checks at start that this is what the whole chat encodes to (prefix stability), and that the parser
reads the calls the template writes. Also the run's warning when the policy calls no tool it can read, and the
slow tool's seconds (--tool_latency)."""
import json
import logging
import math
import random
import time
from typing import Optional

from tqdm import tqdm

from plumbing.core import fail

EXAMPLE_VALUES = {"string": "1 + 2", "integer": 1, "number": 1.0, "boolean": True, "array": [], "object": {}}


def schemas(functions: list) -> list[dict]:
    """Each tool's JSON schema, from its signature and docstring (a clear error for one that has none)."""
    from transformers.utils import get_json_schema

    found = []
    for function in functions:
        try:
            found.append(get_json_schema(function))
        except Exception as e:  # (a missing type hint or argument description)
            fail(f"tool {getattr(function, '__name__', function)!r}: no JSON schema ({e}); a tool is a Python "
                 "function with a type hint on every argument and a Google-style docstring describing each")
    return found


def register_calculator() -> None:
    """The tiny world's call syntax as a vLLM tool parser named "calculator": a turn ending "... <<23 + 11>>" calls
    calculator(expression="23 + 11"); a turn with no "<<" has no call it can read."""
    from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
    from vllm.tool_parsers import ToolParser, ToolParserManager

    if "calculator" in ToolParserManager.list_registered():
        return

    class CalculatorToolParser(ToolParser):
        tool_call_start_token, tool_call_end_token = "<<", ">>"

        def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
            if self.tool_call_start_token not in model_output:
                return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
            content, expression = model_output.rsplit(self.tool_call_start_token, 1)
            call = FunctionCall(name="calculator", arguments=json.dumps(
                {"expression": expression.removesuffix(self.tool_call_end_token)}))
            return ExtractedToolCallInformation(tools_called=True, tool_calls=[ToolCall(function=call)],
                                                content=content or None)

    ToolParserManager.register_module("calculator", module=CalculatorToolParser)


def make_parser(name: str, tokenizer):
    """vLLM's tool parser `name` for this tokenizer (quiet: a call that fails to parse is counted, not logged)."""
    register_calculator()
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_class = ToolParserManager.get_tool_parser(name)
    except KeyError:
        fail(f"--tool_parser {name}: not one of vLLM's parsers ({', '.join(ToolParserManager.list_registered())})")
    try:
        parser = parser_class(tokenizer)
    except Exception as e:  # (llama3_json on a tokenizer without <|python_tag|>, ...)
        fail(f"--tool_parser {name} does not fit the policy's tokenizer: {e}")
    logging.getLogger(parser_class.__module__).setLevel(logging.CRITICAL)
    return parser


def parse_calls(parser, text: str) -> tuple[list, bool]:
    """The calls a turn's text makes, as (name, arguments, error) triples (error: arguments that are not a JSON
    object), and whether it tried to call and failed to parse (the parser's opening mark with no call read)."""
    info = parser.extract_tool_calls(text, None)
    if not info.tools_called:
        return [], getattr(parser, "tool_call_start_token", None) in text
    calls = []
    for call in info.tool_calls:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            arguments = None
        calls.append((call.function.name, arguments, None if isinstance(arguments, dict) else
                      f"error: the arguments of {call.function.name} are not a JSON object"))
    return calls, False


def run_call(function, arguments: dict, delay: float) -> str:
    """A call, in a worker thread: `delay` seconds first (--tool_latency's simulated slow tool), then the function."""
    time.sleep(delay)
    return str(function(**arguments))


def call_outputs(calls: list, timeout: float, now: float) -> Optional[list[tuple[str, str]]]:
    """Once every call of a turn has answered or timed out: each one's output text and outcome ("ok", "error" for
    an unknown tool, bad arguments or a tool that raised, "timeout"); None while one is still running."""
    if not all(c["future"] is None or c["future"].done() or now - c["started"] > timeout for c in calls):
        return None
    outputs = []
    for call in calls:
        future = call["future"]
        if future is None:  # (refused before it ran: its error is its output)
            outputs.append((call["error"], "error"))
        elif not future.done():  # (a thread cannot be stopped: its answer, when it comes, is dropped)
            future.cancel()
            outputs.append((f"error: {call['name']} timed out after {timeout:g} s", "timeout"))
        elif future.exception() is not None:
            error = future.exception()
            outputs.append((f"error: {call['name']} raised {type(error).__name__}: {error}", "error"))
        else:
            outputs.append((future.result(), "ok"))
    return outputs


def cap_output(tokenizer, text: str, max_tokens: int) -> str:
    """A tool's output cut to its first `max_tokens` tokens (said in the text: the policy sees it was cut)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return text if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens]) + " [cut]"


def reply_ids(tokenizer, turn_format: dict, outputs: list[str], names: list[str]) -> list[int]:
    """The replies to a turn's calls as token ids of their own: the chat template's tool messages and the next
    assistant header (turn_format's dummy chat's tail: checked prefix-stable at start), or, with no chat template,
    " = <output>\\n" after each call (an error: " = error\\n", the tiny world's)."""
    if not turn_format["chat"]:
        text = "".join(f" = {'error' if output.startswith('error:') else output}\n" for output in outputs)
        return tokenizer.encode(text, add_special_tokens=False)
    messages = [*turn_format["dummy"], *[dict(role="tool", name=name, content=output)
                                         for name, output in zip(names, outputs)]]
    text = tokenizer.apply_chat_template(messages, tools=turn_format["schemas"], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text[turn_format["cut"]:], add_special_tokens=False)


def example_call(schema: dict) -> dict:
    """A call of a tool with placeholder arguments, for the checks at start."""
    properties = schema["function"].get("parameters", {}).get("properties", {})
    return dict(name=schema["function"]["name"],
                arguments={key: EXAMPLE_VALUES.get(p.get("type"), "x") for key, p in properties.items()})


def turn_format(tokenizer, parser_name: str, tool_schemas: list[dict], chat: bool, end_of_turn: int,
                model_path: str) -> dict:
    """How a turn ends and how replies are written, checked at start (the run refuses a policy whose tokenizer,
    template and parser disagree, naming them). Chat: a turn ends at the template's end of turn; the parser must
    read the call the template writes; the chat up to the call's end of turn and the template's tool message with
    the next assistant header, each encoded on its own, must be the whole chat encoded, the earlier text unchanged
    (prefix stability: what trains is what serves). No chat template: a turn also stops at the parser's closing
    mark (its last token; a mark of several is checked on the text), which must end a call in context as alone."""
    parser, call = make_parser(parser_name, tokenizer), example_call(tool_schemas[0])
    if not chat:
        end_mark = getattr(parser, "tool_call_end_token", None)
        if not end_mark:
            fail(f"--tool_parser {parser_name} has no closing mark to stop a turn at: with no chat template, a "
                 "turn must stop at the call's end (use --prompt_format chat with a policy that has a template)")
        end_ids = tokenizer.encode(end_mark, add_special_tokens=False)
        example = f"x {parser.tool_call_start_token}{call['arguments'].get('expression', '1 + 2')}{end_mark}"
        in_context = tokenizer.encode(example, add_special_tokens=False)
        if in_context[-1] != end_ids[-1]:
            fail(f"--sft_model_path {model_path}: its tokenizer writes the call's closing mark {end_mark!r} as "
                 f"{in_context[-len(end_ids):]} after a call but {end_ids} alone: a turn would never stop at it "
                 "(add it as a special token and fine-tune the policy on calls: docs/agentic.md)")
        if not parse_calls(parser, example)[0]:
            fail(f"--tool_parser {parser_name} reads no call in {example!r}")
        return dict(chat=False, parser=parser_name, stop_ids=[end_ids[-1]], end_mark=end_mark, example=example)

    def render(messages: list, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tools=tool_schemas, add_generation_prompt=generation_prompt,
                                             tokenize=False)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    user = [dict(role="user", content="What is 1 + 2?")]
    dummy = [*user, dict(role="assistant", content="", tool_calls=[dict(type="function", function=call)])]
    prompt, whole = render(user, True), render(dummy, False)
    end_text = tokenizer.decode([end_of_turn])
    if not whole.startswith(prompt) or end_text not in whole[len(prompt):]:
        fail(f"--sft_model_path {model_path}: its chat template writes an assistant's tool call that does not "
             f"follow its own generation prompt, or does not end it with {end_text!r}")
    cut = whole.rindex(end_text) + len(end_text)  # (the call ends at the end of turn: a turn's last sampled id)
    written = whole[len(prompt): cut - len(end_text)]
    calls, _ = parse_calls(parser, written)
    if [(name, arguments) for name, arguments, _ in calls] != [(call["name"], call["arguments"])]:
        fail(f"--tool_parser {parser_name} does not read the calls the chat template of --sft_model_path "
             f"{model_path} writes ({written!r}): pass the parser `vllm serve` uses for this model")
    answered = render([*dummy, dict(role="tool", name=call["name"], content="3")], True)
    if not answered.startswith(whole[:cut]) or encode(whole[:cut]) + encode(answered[cut:]) != encode(answered):
        fail(f"--sft_model_path {model_path}: its chat template is not prefix-stable: the tool's reply and the next "
             "assistant header, encoded on their own after the chat so far, are not the whole chat encoded (the "
             f"chat: {answered!r}), so the ids trained on would not be the ids served. Use a template that only "
             "appends (one that rewrites earlier turns, as some strip reasoning from past turns, cannot be trained "
             "token in, token out)")
    return dict(chat=True, parser=parser_name, stop_ids=[], schemas=tool_schemas, dummy=dummy, cut=cut,
                example=written)


# --- agentic_grpo.py's run: a policy that calls no tool said, the slow tool's seconds -----------------------------
def say_if_no_calls(batch: list, ledger: dict, tool: dict, version: int, args) -> None:
    """Says once, after the third step, when the policy has called no tool, or when none of its calls could be read:
    a policy that has not learned the format --tool_parser reads trains with no tool, silently otherwise."""
    seen = ledger["calls_seen"]
    seen[:] = [seen[0] + sum(len(g["calls"]) for g in batch), seen[1] + sum(sum(g["calls"]) for g in batch),
               seen[2] + sum(sum(g["parse_failures"]) for g in batch)]
    episodes, tried, unread = seen
    if version != min(3, args.num_steps) or args.rank != 0 or (tried and unread < tried):
        return
    example = tool["turn_format"]["example"]
    tqdm.write(f"warning: the policy called no tool in its first {episodes} episodes" if not tried else
               f"warning: none of the policy's {tried} calls in its first {episodes} episodes could be read")
    tqdm.write(f"  --tool_parser {args.tool_parser} reads calls written like {example!r} (with --prompt_format chat, "
               "the tools' schemas are in the prompt): a policy that does not write them trains without the tool")


def latency(tool: dict, rng: random.Random) -> float:
    """Seconds a call takes: --tool_latency, fixed or long-tailed (lognormal, sigma 1, the same mean)."""
    if tool["latency_distribution"] == "fixed":
        return tool["latency"]
    if tool["latency_distribution"] == "lognormal":
        return tool["latency"] and rng.lognormvariate(math.log(tool["latency"]) - 0.5, 1.0)
    raise ValueError(f"unknown --tool_latency_distribution {tool['latency_distribution']}")
