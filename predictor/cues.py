"""Length cues that carry across instruction sources ("ranking that transfers").

Why: a predictor trained on one source's words learns that source's vocabulary; on traffic from
another source (code instructions, tool-use prompts) most of its n-grams are rare or mean
something else, and Kendall τ fell from 0.55 to 0.23. What a request says about the *form* of its
answer is shared by every source: whether it asks for code, a list of N items, one word or one
sentence, an essay, an explanation or a rewrite of its input (length follows the input), a yes/no
or a classification. These cues are a few dozen numbers from regular expressions, cheap enough
for the gateway, and are appended to the ``semantic`` predictor's features.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from predictor.base import PredictItem

_NUM_WORDS = {"one": 1, "a single": 1, "single": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
              "seven": 7, "eight": 8, "nine": 9, "ten": 10, "twelve": 12, "fifteen": 15, "twenty": 20,
              "a few": 3, "several": 5, "a couple of": 2}
_NUM = r"(\d+|" + "|".join(re.escape(k) for k in _NUM_WORDS) + r")"


def _flag(pattern: str) -> re.Pattern[str]:
    """Patterns are matched against lower-cased text: re.IGNORECASE costs ~2× on these alternations."""
    return re.compile(pattern)


# name -> pattern searched in the instruction (and the input, where the request may be there)
FLAGS: dict[str, re.Pattern[str]] = {
    "code_task": _flag(r"\b(write|create|implement|generate|develop|construct|build|design|code|complete|fix|"
                       r"debug|refactor|modify|edit|rewrite|optimi[sz]e|convert)\b[^.?!]{0,60}\b(code|function|"
                       r"program|script|class|method|query|algorithm|snippet|loop|api|regex|regular expression|"
                       r"html|css|sql|component|endpoint|module|app|application|page|statement)s?\b"),
    "code_language": _flag(r"\b(python|java|javascript|typescript|c\+\+|c#|ruby|php|swift|kotlin|golang|rust|"
                           r"sql|mysql|html|css|bash|shell|perl|scala|matlab|react|node\.?js|jquery|django|"
                           r"numpy|pandas)\b"),
    "one_word": _flag(r"\b(one|single|a) word\b|\bin a word\b|\bone-word\b"),
    "one_sentence": _flag(r"\b(one|single|a) sentence\b|\bone-sentence\b|\bin a sentence\b"),
    "short": _flag(r"\b(brief|briefly|short|concise|concisely|succinct|tweet|headline|title|slogan|caption|"
                   r"tagline|name|acronym|hashtag)\b"),
    "long_form": _flag(r"\b(essay|story|article|blog|letter|speech|poem|report|script|narrative|dialogue|"
                       r"conversation|song|lyrics|guide|tutorial|plan|proposal|review|cover letter)\b"),
    "explain": _flag(r"\b(explain|describe|elaborate|discuss|analy[sz]e|compare|contrast|detail|detailed|"
                     r"step[- ]by[- ]step|steps|outline|why|how (do|does|can|to|would|should))\b"),
    "list": _flag(r"\b(list|enumerate|brainstorm|suggest|examples|ideas|tips|ways|reasons|steps|items)\b"),
    "classify": _flag(r"\b(classify|categori[sz]e|identify|determine|detect|label|which (one|of)|true or false|"
                      r"yes or no|is it|is this|does this|sentiment|positive or negative|correct or incorrect)\b"),
    "rewrite": _flag(r"\b(rewrite|rephrase|paraphrase|translate|correct|proofread|edit|reword|convert|"
                     r"transform|simplify|shorten|summari[sz]e|reverse|sort|format)\b"),
    "calc": _flag(r"\b(calculate|compute|solve|evaluate|what is \d|how (many|much)|sum|average|convert \d)\b|"
                  r"\d\s*[-+*/^]\s*\d"),
    "wh_question": _flag(r"^\s*(what|who|when|where|which|whose|whom)\b"),
    "yn_question": _flag(r"^\s*(is|are|was|were|do|does|did|can|could|should|would|will|has|have)\b"),
    "format": _flag(r"\b(json|table|csv|bullet|markdown|xml|yaml|numbered|outline|template)\b"),
    "tool": _flag(r"\b(api|tool|search|lookup|look up|query|call|wikipedia|weather|calendar|news)\b"),
}
_COUNT = _flag(r"\b" + _NUM + r"\s+(?:\w+\s+){0,2}?(items|examples|ideas|tips|ways|reasons|steps|things|words|"
               r"sentences|paragraphs|points|questions|names|facts|adjectives|synonyms|lines|bullet points)\b")
_WORDS = _flag(r"\b" + _NUM + r"[- ](word|words)\b")
_SENTENCES = _flag(r"\b" + _NUM + r"[- ](sentence|sentences)\b")
_PARAGRAPHS = _flag(r"\b" + _NUM + r"[- ](paragraph|paragraphs)\b")
_CODE_CHARS = re.compile(r"[{}();=\[\]<>]")
_HAS_NUMBER = re.compile(r"\d|\b(one|single|two|three|four|five|six|seven|eight|nine|ten|twelve|fifteen|twenty|"
                         r"few|several|couple)\b")
SCAN_CHARS = 400  # regexes read the instruction's last / the input's first 400 characters: bounded cost per request

NAMES = (*FLAGS, "log_count", "log_words_asked", "log_sentences_asked", "log_paragraphs_asked",
         "input_code_density", "log_input_lines", "rewrite_x_input", "log_input_chars", "log_instruction_chars")


def _number(text: str) -> float:
    t = text.lower()
    return float(t) if t.isdigit() else float(_NUM_WORDS.get(t, 0))


def _first(pattern: re.Pattern[str], text: str) -> float:
    m = pattern.search(text)
    return float(np.log1p(min(_number(m.group(1)), 5000.0))) if m else 0.0


def cue_features(items: Sequence[PredictItem]) -> np.ndarray:
    """One row of ``NAMES`` per item (float32): flags, asked-for counts, input shape."""
    rows = []
    for it in items:
        instr, inp = it.instruction, it.user_input
        both = f"{instr[-SCAN_CHARS:]}\n{inp[:SCAN_CHARS]}".lower()  # the ask is at the instruction's end
        head_instr = instr[:SCAN_CHARS].lower()
        flags = [float(bool(p.search(head_instr if name in ("wh_question", "yn_question") else both)))
                 for name, p in FLAGS.items()]
        n_in = len(inp)
        head = inp[:2000]
        code_density = len(_CODE_CHARS.findall(head)) / max(len(head), 1)
        rewrite = flags[list(FLAGS).index("rewrite")]
        log_in = float(np.log1p(n_in))
        counted = _HAS_NUMBER.search(both) is not None  # the four count patterns need a number first
        rows.append([*flags, *((_first(p, both) for p in (_COUNT, _WORDS, _SENTENCES, _PARAGRAPHS)) if counted
                               else (0.0,) * 4),
                     code_density, float(np.log1p(inp.count("\n"))), rewrite * log_in,
                     log_in, float(np.log1p(len(instr)))])
    return np.asarray(rows, dtype=np.float32).reshape(len(rows), len(NAMES))
