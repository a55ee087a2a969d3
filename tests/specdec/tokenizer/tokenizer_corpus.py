"""Real text for tokenizer tests: multilingual prose, emoji, and Python source from the standard library."""

from __future__ import annotations

import inspect
import json.decoder
import textwrap

PROSE = [
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see what they've done, didn't we?",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein. Größe, Straße, Ärger.",
    "L'été dernier, nous sommes allés à la plage ; c'était très agréable, n'est-ce pas ?",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва 1147 год.",
    "我能吞下玻璃而不伤身体。北京是中华人民共和国的首都，人口约2189万。",
    "いろはにほへと ちりぬるを。東京タワーは高さ333メートルです。カタカナ、ひらがな。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요. 서울특별시",
    "أنا قادر على أكل الزجاج و هذا لا يؤلمني. القاهرة عاصمة مصر.",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती.",
    "Τη γλώσσα μου έδωσαν ελληνική. Αθήνα, Θεσσαλονίκη.",
    "Emoji: 🙂👍🏽 👨‍👩‍👧‍👦 🇺🇦 ✔︎ — “quotes” «guillemets» ‘single’ … ½ ∑ ∞ ≠ €100",
    "Numbers 3.14159 and 1,000,000 and 0x1F; dates 2024-06-01T12:00:00Z.",
    "Tabs\tand  double  spaces,\n\nblank lines,\r\nCRLF lines, trailing spaces   \n   leading.",
]

CODE = [
    inspect.getsource(json.decoder),
    inspect.getsource(textwrap),
    'fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", v);\n}\n',
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY id DESC LIMIT 10;",
    '{"key": [1, 2, 3], "nested": {"ok": true, "none": null}}',
]

SPECIAL_LOOKING = [
    "<|eos|> at the start and <|separator|> in the middle, <|pad|>",
    "<|endoftext|><|fim_prefix|>x<|fim_suffix|> <|im_start|>user<|im_end|> <|eot_id|>",
]

CORPUS = PROSE + CODE + SPECIAL_LOOKING


def corpus_text() -> str:
    return "\n".join(CORPUS)
