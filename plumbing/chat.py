"""Chat datasets: rows with a `messages` column (a list of {role, content}, the Hugging Face chat
format, as No Robots has) turned into the `query` and `reference_response` the scripts read, with
the policy tokenizer's own chat template; a problem's prompt in the template (the GRPO twins, the
tools' schemas rendered); and the token that ends an assistant turn."""
import os
from typing import Optional

from plumbing.core import bos_prefix, fail


def end_of_turn_id(tokenizer) -> int:
    """The token the chat template writes right after an assistant's answer, if it is a special token
    (Llama 3.1's <|eot_id|>, ChatML's <|im_end|>); else EOS (Tulu's and Zephyr's templates end a turn
    with EOS itself)."""
    answer = "The answer."
    text = tokenizer.apply_chat_template([dict(role="user", content="A question?"),
                                          dict(role="assistant", content=answer)], tokenize=False)
    after = tokenizer(text[text.rindex(answer) + len(answer):], add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return after[0] if after and after[0] in special else tokenizer.eos_token_id


def format_chats(splits: dict, dataset: str, tokenizer, tokenizer_path: str, max_prompt_length: int) -> dict:
    """Each split with `query`: every turn but the last in the chat template, then its generation
    prompt; `reference_response`: the last (assistant) turn's text and the end-of-turn token. A
    prompt longer than max_prompt_length is left out, not cut (cutting its start would cut the
    template's), and counted."""
    if tokenizer.chat_template is None:
        fail(f"--dataset {dataset} is a chat dataset (a `messages` column), but the tokenizer of "
             f"--sft_model_path {tokenizer_path} has no chat template to format it with: pass a "
             f"policy whose tokenizer has one (`chat_template` in its tokenizer_config.json)")
    end_of_turn = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    bos, bos_text = bos_prefix(tokenizer), tokenizer.bos_token or ""

    def render(row: dict) -> dict:
        *turns, answer = row["messages"]
        if answer["role"] != "assistant" or not turns:
            fail(f"--dataset {dataset}: a chat must end with an assistant turn after at least one "
                 f"other; found {[turn['role'] for turn in row['messages']]}")
        query = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
        if bos:  # the tokenizer adds BOS itself (core.tokenize_prompts): not twice
            query = query.removeprefix(bos_text)
        return dict(query=query, reference_response=answer["content"] + end_of_turn)

    formatted = {}
    for name, split in splits.items():
        split = split.map(render)
        lengths = [len(bos) + len(ids) for ids in
                   tokenizer(list(split["query"]), add_special_tokens=False)["input_ids"]]
        kept = [i for i, length in enumerate(lengths) if length <= max_prompt_length]
        if len(kept) < len(split) and int(os.getenv("RANK", "0")) == 0:
            print(f"--dataset {dataset}: {len(split) - len(kept)} of {len(split)} {name} chats left "
                  f"out: their prompts are longer than --max_prompt_length {max_prompt_length} tokens")
        if not kept:
            fail(f"--dataset {dataset}: every {name} chat is longer than --max_prompt_length "
                 f"{max_prompt_length} tokens")
        formatted[name] = split.select(kept)
    return formatted


def chat_prompts(tokenizer, chats: list, tokenizer_path: str, tools: Optional[list] = None) -> list[str]:
    """Each chat's turns (a last assistant turn, the reference, left out) in the tokenizer's chat
    template with `tools`' JSON schemas, ending with the generation prompt: the prompt ends at the
    assistant header. Without the BOS the tokenizer adds itself."""
    if tokenizer.chat_template is None:
        fail(f"--prompt_format chat: the tokenizer of --sft_model_path {tokenizer_path} has no chat "
             f"template (`chat_template` in its tokenizer_config.json): pass a --prompt_format with "
             f"{{question}} instead, or a policy that has one")
    bos, bos_text = bos_prefix(tokenizer), tokenizer.bos_token or ""
    texts = []
    for turns in chats:
        turns = turns[:-1] if turns and turns[-1]["role"] == "assistant" else turns
        text = tokenizer.apply_chat_template(turns, tools=tools or None, add_generation_prompt=True,
                                             tokenize=False)
        texts.append(text.removeprefix(bos_text) if bos else text)
    return texts
