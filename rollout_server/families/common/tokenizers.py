"""Real CLIP, T5, Qwen2 and Mistral tokenizers trained locally on a small embedded corpus.

The presets must never touch a model hub, so instead of downloading the models' tokenizers we train tokenizers
with the same algorithms and file conventions (byte-level BPE for CLIP, Qwen2 and Mistral, SentencePiece
unigram for T5) on the caption-like text below. Training is deterministic, so the files are byte-identical
across builds.
"""

import heapq
import io
import json
import re
from collections import Counter, defaultdict
from itertools import pairwise
from pathlib import Path

import sentencepiece as spm
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    CLIPTokenizer,
    GemmaTokenizer,
    PreTrainedTokenizerFast,
    Qwen2Tokenizer,
    T5TokenizerFast,
)

CORPUS = """\
A photo of a red fox sitting in the snow, 4k, highly detailed.
An oil painting of a lighthouse on a rocky cliff at sunset!
Two cats sleeping on a blue sofa next to a window while rain falls outside.
A bowl of ramen with eggs, noodles and green onions; studio lighting.
The quick brown fox jumps over the lazy dog 123 times.
Café-style latte art in a white cup, top view, 35mm photograph.
A watercolor map of an old city with narrow streets and tiny bridges.
Portrait of an elderly woman smiling, soft window light, film grain.
A futuristic train crossing a desert at night under a sky full of stars.
Close-up of a honeybee on a yellow sunflower, macro lens, shallow depth of field.
Three wooden boats floating on a calm lake surrounded by pine trees.
A child flying a kite on a windy beach in autumn.
A steaming cup of coffee next to an open book and a pair of glasses.
An astronaut riding a horse on the moon, digital art, trending on artstation.
A cozy cabin in the mountains covered with fresh snow, warm light in the windows.
A golden retriever puppy playing with a tennis ball in the garden.
A neon sign that says "open 24/7" reflected in a puddle on a dark street.
A bustling market in Marrakesh with spices, lanterns and colorful fabrics.
A minimalist logo of a mountain and a river, flat vector, two colors.
An ancient stone temple hidden in a dense jungle, mist rising at dawn.
A robot painting a self-portrait in a sunny studio, whimsical illustration.
A plate of sushi with salmon, tuna and avocado on a black slate board.
A snowy owl perched on a fence post, looking straight at the camera.
A vintage red car parked in front of a small diner in 1957.
A field of purple lavender under a cloudy summer sky in Provence.
A stack of pancakes with blueberries, maple syrup and a pat of butter.
Aerial view of a winding river through a green valley, drone shot.
A medieval knight in shining armor holding a sword and a round shield.
A glass jar filled with fireflies glowing in the dark forest.
A cyberpunk city skyline at dusk with flying cars and giant holograms.
A tabby cat wearing a tiny wizard hat, reading a spell book.
Fresh bread and cheese on a rustic wooden table by the kitchen window.
A polar bear swimming under the ice, sunlight streaming through the water.
A sailboat on rough seas during a storm, dramatic waves, oil on canvas.
A colorful hot air balloon festival over the hills at sunrise.
A portrait of a young man with curly hair and freckles, 85mm, f/1.8.
A bonsai tree on a wooden shelf, soft natural light, white background.
An underwater coral reef with clownfish, turtles and bright blue water.
A chalkboard with mathematical equations: e = mc^2 and a^2 + b^2 = c^2.
A pixel art castle on a floating island, 16-bit video game style.
A violin resting on sheet music beside a burning candle.
Rainy streets of Tokyo at night, umbrellas, reflections and glowing signs.
A hand-drawn sketch of a hummingbird drinking nectar from a flower.
A modern kitchen with marble counters, copper pots and hanging plants.
A giraffe eating leaves from a tall acacia tree on the savanna.
A bright yellow taxi driving across a bridge in New York City.
An empty wooden pier stretching into the fog on a quiet morning.
A bouquet of roses, tulips and daisies in a blue ceramic vase.
A lonely tree on a hill under the milky way, long exposure photography.
A dragon made of clouds soaring above a mountain range.
Children building a sandcastle while seagulls fly overhead.
A bicycle leaning against a brick wall covered with ivy.
A scientist looking through a microscope in a clean white laboratory.
A festival of lanterns floating on a river, thousands of warm lights.
A chocolate cake with strawberries, cream and a single birthday candle.
An isometric 3D render of a tiny office with desks, computers and plants.
A wolf howling at the full moon on a frozen lake, blue tones.
A street musician playing guitar for a small crowd in the evening.
Autumn leaves in red, orange and gold falling on a park bench.
A hyperrealistic close-up of a human eye with a galaxy in the iris.
"""

CLIP_EOW = "</w>"
CLIP_BOS, CLIP_EOS = "<|startoftext|>", "<|endoftext|>"


def _clip_word_counts(lines: list[str]) -> Counter[tuple[str, ...]]:
    """Splits the corpus exactly like CLIPTokenizer does, so every trained merge is reachable at runtime."""
    backend = CLIPTokenizer().backend_tokenizer
    counts: Counter[tuple[str, ...]] = Counter()
    for line in lines:
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)):
            counts[(*word[:-1], word[-1] + CLIP_EOW)] += 1
    return counts


def _train_bpe_merges(counts: Counter[tuple[str, ...]], num_merges: int) -> list[tuple[str, str]]:
    """Classic BPE training: merge the most frequent adjacent pair, ties broken on the pair itself so the
    result never depends on hash order, until ``num_merges`` or no pair is left.

    A merge rewrites only the words that hold its pair, left to right as a tokenizer applies it, and
    moves only their pairs' counts; the next pair comes off a heap of (-count, pair), an entry whose
    count is no longer the pair's own being dropped when it surfaces."""
    words = [list(word) for word in counts]
    freqs = list(counts.values())
    pair_counts: Counter[tuple[str, str]] = Counter()
    holders: defaultdict[tuple[str, str], set[int]] = defaultdict(set)
    for index, word in enumerate(words):
        for pair in pairwise(word):
            pair_counts[pair] += freqs[index]
            holders[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[str, str]] = []
    while len(merges) < num_merges and heap:
        negative_count, best = heapq.heappop(heap)
        if pair_counts.get(best, 0) != -negative_count:
            continue  # a stale entry: the pair's count moved after it was pushed
        merges.append(best)
        moved = set()
        for index in holders.pop(best):
            word, freq = words[index], freqs[index]
            symbols, i = [], 0
            while i < len(word):
                if word[i] == best[0] and i + 1 < len(word) and word[i + 1] == best[1]:
                    symbols.append(best[0] + best[1])
                    i += 2
                else:
                    symbols.append(word[i])
                    i += 1
            for pair in pairwise(word):
                pair_counts[pair] -= freq
                moved.add(pair)
            for pair in pairwise(symbols):
                pair_counts[pair] += freq
                holders[pair].add(index)
                moved.add(pair)
            words[index] = symbols
        for pair in moved:
            if pair_counts[pair] > 0:
                heapq.heappush(heap, (-pair_counts[pair], pair))
            else:
                del pair_counts[pair]
    return merges


def write_clip_tokenizer(folder: Path, vocab_size: int, corpus: str = CORPUS) -> None:
    """Writes a byte-level BPE CLIP tokenizer with at most `vocab_size` tokens (vocab.json, merges.txt),
    trained on `corpus`.

    The vocabulary follows OpenAI CLIP's layout: the 256 byte symbols, the same symbols with `</w>`, one token
    per merge, then the two special tokens. Having every byte in the vocabulary means any text (unseen words,
    digits, emoji) tokenizes without unknown tokens.
    """
    byte_symbols = sorted(ByteLevel.alphabet())  # code point order == CLIP's bytes_to_unicode order
    num_merges = vocab_size - 2 * len(byte_symbols) - 2
    merges = _train_bpe_merges(_clip_word_counts(corpus.splitlines()), num_merges)
    tokens = byte_symbols + [s + CLIP_EOW for s in byte_symbols] + ["".join(m) for m in merges]
    vocab = {token: i for i, token in enumerate([*tokens, CLIP_BOS, CLIP_EOS])}

    # transformers 5 only saves tokenizer.json; vocab.json + merges.txt keep the layout FLUX.1-dev ships.
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "".join(f"{a} {b}\n" for a, b in merges)
    (folder / "merges.txt").write_text("#version: 0.2\n" + merges_text, encoding="utf-8")
    CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77).save_pretrained(folder)


def write_t5_tokenizer(
    folder: Path, vocab_size: int, corpus: str = CORPUS, model_max_length: int = 512
) -> None:
    """Writes a SentencePiece unigram T5 tokenizer (spiece.model, tokenizer.json) like google/t5-v1_1,
    trained on `corpus`; `model_max_length` is the text length a pipeline pads prompts to.

    `vocab_size` is a soft limit: the small corpus supports only so many pieces. T5's 100 `<extra_id_*>`
    sentinels are appended on top, as in the original.
    """
    model = io.BytesIO()
    spm.set_random_generator_seed(0)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus.splitlines()),
        model_writer=model,
        model_type="unigram",
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        character_coverage=1.0,
        required_chars="".join(map(chr, range(33, 127))),  # all printable ASCII, even if unseen in CORPUS
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        num_threads=1,
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spiece.model").write_bytes(model.getvalue())
    # Loading from spiece.model runs transformers' own SentencePiece conversion; saving adds tokenizer.json.
    T5TokenizerFast.from_pretrained(folder, model_max_length=model_max_length).save_pretrained(folder)


QWEN2_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen3's vocabulary adds the markers of its reasoning block.
QWEN3_SPECIAL_TOKENS = (*QWEN2_SPECIAL_TOKENS, "<think>", "</think>")
# Qwen3's chat template for plain conversations (its tool calls and reasoning history left out): each turn
# between <|im_start|> and <|im_end|>, then the generation prompt, which with enable_thinking=False opens
# and closes an empty reasoning block, as Qwen3 does.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _whole_word_merges(extra_text: str) -> list[tuple[str, str]]:
    """Byte-level BPE merges trained on the corpus plus `extra_text` until every training word is a single
    token, the words split by Qwen2's normaliser and pre-tokenizer (GPT-4's pattern, which Mistral's tekken
    splits by too)."""
    backend = Qwen2Tokenizer().backend_tokenizer
    counts: Counter[tuple[str, ...]] = Counter()
    for line in (CORPUS + extra_text).splitlines(keepends=True):
        for word, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)):
            counts[tuple(word)] += 1
    max_merges = sum(len(word) - 1 for word in counts)  # enough to merge every word into one token
    return _train_bpe_merges(counts, max_merges)


def write_qwen2_tokenizer(
    folder: Path,
    extra_text: str,
    special_tokens: tuple[str, ...] = QWEN2_SPECIAL_TOKENS,
    chat_template: str | None = None,
    model_max_length: int = 131072,
) -> None:
    """Writes a byte-level BPE Qwen2 tokenizer (vocab.json, merges.txt, tokenizer.json) like Qwen2.5-VL's.

    Trained on the corpus plus `extra_text` (e.g. a pipeline's prompt template) until every training word is a
    single token, as the words of such templates are in Qwen2's real vocabulary: pipelines that drop a fixed
    number of template tokens then drop exactly the template. The vocabulary follows Qwen2's layout: the 256
    byte symbols, one token per merge, then the `special_tokens` (chat and vision markers; Qwen3's add its
    reasoning markers). `chat_template` is what `apply_chat_template` renders, and `model_max_length` the
    text length a pipeline that reads it pads prompts to.
    """
    merges = _whole_word_merges(extra_text)
    tokens = sorted(ByteLevel.alphabet()) + ["".join(m) for m in merges] + list(special_tokens)
    vocab = {token: i for i, token in enumerate(tokens)}

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merges_text = "".join(f"{a} {b}\n" for a, b in merges)
    (folder / "merges.txt").write_text("#version: 0.2\n" + merges_text, encoding="utf-8")
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(special_tokens),
        model_max_length=model_max_length,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


# Mistral Small 3.1's control tokens (its tokenizer numbers them first), the image markers among them.
MISTRAL_SPECIAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
)
# Mistral Small 3.1's chat template for system, user and assistant turns of text and image blocks (its
# default system message, dates and tool calls left out): the beginning of text, the system prompt between
# its markers, each user turn as an instruction, each image block as an image marker.
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' }}{%- endif %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{{- block['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[/INST]' }}{%- else %}{{- eos_token }}{%- endif %}"
    "{%- endfor %}"
)


def write_mistral_tokenizer(folder: Path, extra_text: str, model_max_length: int) -> None:
    """Writes a byte-level BPE tokenizer (tokenizer.json) like Mistral Small 3.1's, with its chat template.

    Trained as `write_qwen2_tokenizer`'s (every word of the corpus and of `extra_text`, e.g. a pipeline's
    system message, one token); the vocabulary is Mistral's layout: its control tokens first, then the 256
    byte symbols and one token per merge. `model_max_length` is the text length a pipeline pads prompts to.
    """
    merges = _whole_word_merges(extra_text)
    tokens = list(MISTRAL_SPECIAL_TOKENS) + sorted(ByteLevel.alphabet()) + ["".join(m) for m in merges]
    vocab = {token: i for i, token in enumerate(tokens)}
    # Qwen2's byte-level BPE backend over this vocabulary: the same normaliser, split and byte decoding.
    backend = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None).backend_tokenizer
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=list(MISTRAL_SPECIAL_TOKENS[3:]),
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


# Gemma 3's control tokens (its vocabulary numbers the first five first), chat-turn markers and image markers.
GEMMA3_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
GEMMA_SPACE = "\u2581"  # SentencePiece's word marker, which Gemma's normaliser writes for every space
# Gemma 3's chat template for text turns (images left out): the beginning of text, a system message folded
# into the first user turn, each turn between <start_of_turn> and <end_of_turn> with the assistant called
# "model", then the generation prompt.
GEMMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set first_user_prefix = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{- message['content'] | trim }}{{- '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)


def write_gemma_tokenizer(
    folder: Path, vocab_size: int, corpus: str = CORPUS, model_max_length: int = 128
) -> None:
    """Writes a SentencePiece-style BPE tokenizer with byte fallback (tokenizer.json) like Gemma 3's, with
    its chat template, trained on `corpus`; `model_max_length` is the text length a pipeline that reads it
    pads prompts to.

    As Gemma's, every space is normalised to `▁` (no dummy prefix) and pieces start at a `▁`, so no merge
    spans two words; it adds `<bos>` and pads with `<pad>` on the left. The vocabulary: the special tokens
    (the first five numbered as Gemma 3's), Gemma's 256 byte-fallback tokens `<0x00>`..`<0xFF>` (a character
    outside the vocabulary is spelled in bytes, never unknown), the characters of the corpus and of
    printable ASCII, then one token per merge, up to `vocab_size` tokens.
    """
    counts: Counter[tuple[str, ...]] = Counter()
    for line in corpus.splitlines():
        text = line.replace(" ", GEMMA_SPACE)
        for word in re.findall(f"{GEMMA_SPACE}*[^{GEMMA_SPACE}]+", text):
            counts[tuple(word)] += 1
    printable = set(map(chr, range(33, 127)))  # all printable ASCII, even if unseen in the corpus
    alphabet = sorted({char for word in counts for char in word} | printable | {GEMMA_SPACE})
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    base = [*GEMMA3_SPECIAL_TOKENS, *byte_tokens, *alphabet]
    merges = _train_bpe_merges(counts, vocab_size - len(base))
    # Two merges can spell the same piece: number each piece once, so that the ids have no gaps.
    vocab = {token: i for i, token in enumerate(dict.fromkeys(base + ["".join(m) for m in merges]))}

    tokenizer = GemmaTokenizer(
        vocab=vocab,
        merges=merges,
        add_bos_token=True,
        add_eos_token=False,
        additional_special_tokens=list(GEMMA3_SPECIAL_TOKENS[5:]),
        model_max_length=model_max_length,
        padding_side="left",
    )
    tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
