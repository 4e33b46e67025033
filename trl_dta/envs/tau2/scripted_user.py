"""The offline scripted user of the τ²-bench environment: deterministic keyword matching over the task's user
scenario, no LLM and no network (see :class:`ScriptedUser`).

It is a stand-in for τ²'s LLM user simulator that lets a policy be trained and tested offline; it is much
less adaptive than an LLM user (it does not follow the scenario's conditional instructions, e.g. "if the
agent asks for confirmation, change your mind"). The interface is described in :mod:`.users`.
"""

from __future__ import annotations

import re

from .users import STOP, TRANSFER, scenario_fields

_SUBJECT_BEFORE = {
    "",
    "and",
    "but",
    "or",
    "if",
    "when",
    "because",
    "that",
    "so",
    "then",
    "since",
    "while",
    "as",
    "though",
    "although",
    "unless",
    "until",
    "once",
    "where",
    "whether",
}
# Words that follow an object "you" ("asks you to", "gave you a", "thank you for"); any other next word is
# taken for a verb, so "you" is the subject ("realized you might" -> "realized I might").
_OBJECT_AFTER = {
    "to",
    "a",
    "an",
    "the",
    "for",
    "with",
    "about",
    "if",
    "and",
    "or",
    "that",
    "this",
    "back",
    "some",
    "any",
    "up",
    "in",
    "on",
    "at",
    "from",
    "by",
    "as",
    "so",
    "but",
    "when",
    "again",
}
_PRONOUN_RE = re.compile(
    r"\b(you are|you were|you're|you've|you'd|you'll|yourself|yours|your|you)\b", re.IGNORECASE
)
_FLIP = {
    "you are": "I am",
    "you were": "I was",
    "you're": "I'm",
    "you've": "I've",
    "you'd": "I'd",
    "you'll": "I'll",
    "yourself": "myself",
    "yours": "mine",
    "your": "my",
}


def to_first_person(text: str) -> str:
    """Rewrite a second-person scenario text ("You received your order...") in the first person ("I
    received my order..."). Heuristic: a bare "you" becomes "I" at the start of a clause or before a verb,
    else "me"."""

    def repl(m: re.Match) -> str:
        word = m.group(1).lower()
        if word == "you":
            before = text[: m.start()].rstrip()
            prev = re.findall(r"[A-Za-z']+$", before)
            if prev and prev[0].lower() in ("thank", "see"):
                return m.group(1)
            at_clause_start = (
                not before or before[-1] in ".,;:!?(\n" or (prev and prev[0].lower() in _SUBJECT_BEFORE)
            )
            nxt = re.match(r"\s*([A-Za-z']+)", text[m.end() :])
            object_next = nxt is None or nxt.group(1).lower() in _OBJECT_AFTER
            new = "I" if at_clause_start or not object_next else "me"
        else:
            new = _FLIP[word]
        start = text[: m.start()].rstrip()
        if new[0] != "I" and (not start or start[-1] in ".!?\n"):
            new = new[0].upper() + new[1:]
        return new

    return _PRONOUN_RE.sub(repl, text)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if s.strip()]


# Sentences of the reason for the call that are instructions to the simulator, not things a customer says.
_META_RE = re.compile(
    r"\bagent\b|\breveal|\bmention|\bpretend|\bmake up\b|\bsimulat|\bdo not tell\b|\bdon't tell\b",
    re.IGNORECASE,
)
_NAME_RE = re.compile(
    r"(?:[Nn]ame is|[Cc]alled|[Yy]ou are|[Yy]ou're|I am|I'm)\s+([A-Z][a-z]+)(?:\s+([A-Z][a-z]+))?"
)
_NOT_NAMES = {"In", "From", "And", "The", "A", "An", "Living", "Residing", "User", "Your", "You", "Now"}
_EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_USER_ID_RE = re.compile(r"\b[a-z]+(?:_[a-z]+)+_\d{3,5}\b")
_ZIP_RE = re.compile(r"\b\d{5}\b")
_ORDER_RE = re.compile(r"#?\bW\d{7}\b")
_STREET = (
    r"(?:Drive|Street|Avenue|Road|Lane|Boulevard|Way|Court|Place|Circle|Trail|Parkway|St|Ave|Rd|Ln|Blvd|Dr)"
)
_ADDRESS_RE = re.compile(r"\b\d+\s+[A-Z][A-Za-z]*(?:\s+[A-Z][A-Za-z]*)*\s+" + _STREET + r"\b[^.\n]*")
_PAYMENTS = (
    ("paypal", "PayPal"),
    ("gift card", "gift card"),
    ("credit card", "credit card"),
    ("debit card", "debit card"),
    ("original payment", "original payment method"),
)

# What the agent may ask for: fact -> (question pattern, label used in "I don't know my <label>").
# "strong" facts are identity facts, always answered when asked; the others are not answered when the agent
# also asks for a confirmation (a confirmation message usually restates the order, address, payment...).
_ASKS = {
    "email": (r"e-?mail", "email address", True),
    "name": (r"\bname\b", "name", True),
    "zip": (r"\bzip\b|zip ?code|postal", "zip code", True),
    "user_id": (r"user ?id\b|user_id|username|account id", "user id", True),
    "order_id": (r"order (?:id|number|#)|which order|order ids", "order id", False),
    "address": (r"\baddress\b", "address", False),
    "payment": (r"payment method|pay with|refund (?:to|method)|which card|payment", "payment method", False),
}
# Other facts an airline/other-domain scenario may state in known_info; answered with the known_info sentence.
_OTHER_KEYWORDS = (
    "reservation",
    "confirmation number",
    "membership",
    "phone",
    "birth",
    "passport",
    "booking",
)
_CONFIRM_RE = re.compile(
    r"\bconfirm|\bproceed|yes/no|\(yes|\bshall i\b|\bshould i\b|would you like me to|do you want me to|"
    r"is (?:that|this) (?:correct|right|ok)|\bgo ahead\b|do you agree|are you sure|would you like to",
    re.IGNORECASE,
)
_DONE_RE = re.compile(
    r"anything else|something else|is there any other|all set|all done|"
    r"have a (?:great|nice|good|wonderful) day|goodbye|\bbye\b|(?:has|have) been completed|"
    r"\bis (?:now )?complete\b|\bare (?:now )?complete\b|"
    r"request is done|\bis done\b",
    re.IGNORECASE,
)
_TRANSFER_RE = re.compile(
    r"\btransferr?(?:ed|ing)?\b.*\b(?:human|representative|specialist|agent)", re.IGNORECASE
)


def _strip_meta(reason: str) -> str:
    """The reason for the call without what addresses the simulator: parentheses with a meta word are removed;
    a sentence with one is dropped if it is a condition ("If the agent asks ..."), else cut before the first
    clause that has one ("You want X, but do not reveal Y" -> "You want X.")."""
    text = re.sub(r"\s*\([^()]*\)", lambda m: "" if _META_RE.search(m.group()) else m.group(), reason)
    out = []
    for sentence in _sentences(text):
        if not _META_RE.search(sentence):
            out.append(sentence)
            continue
        if re.match(r"(?:if|when|whenever|unless|once|after|before|in case)\b", sentence, re.IGNORECASE):
            continue
        kept = []
        for clause in re.split(r"(?<=[,;])\s+", sentence):
            if _META_RE.search(clause):
                break
            kept.append(clause)
        if kept:
            out.append(" ".join(kept).rstrip(",; ") + ".")
    return " ".join(out)


class ScriptedUser:
    """Deterministic, offline user built from a τ² user scenario (keyword matching, no LLM).

    * Opening: "Hi! " + the scenario's ``reason_for_call`` in the first person, without what addresses the
      simulator ("(do not reveal ...)", "If the agent asks ...": see ``_strip_meta``).
    * Facts are parsed from ``known_info``: name (or derived from a user id such as ``mei_kovacs_8020``), zip
      code (the first 5-digit number), email(s), user id, street address; order ids (``#W1234567``) and a
      preferred payment method (PayPal, gift card, credit card, ...) from the whole scenario.
    * Each agent message is answered by the first rule that applies:
      1. the agent talks about a transfer to a human -> ``###TRANSFER###``;
      2. the agent says it is done ("anything else?", "has been completed", "goodbye", ...) -> ``###STOP###``;
      3. the agent asks for facts -> one sentence per fact asked (name, zip, email, user id; and order id,
         address, payment method unless it also asks for a confirmation). A fact mentioned in
         ``unknown_info`` gets that sentence ("I do not remember my email address."), a fact the scenario
         lacks gets "I'm sorry, I don't know my <fact>.";
      4. the agent asks for a confirmation ("confirm", "proceed", "yes/no", "shall I", ...) -> "Yes, please go
         ahead." (appended to the identity answers of rule 3 when both apply);
      5. otherwise the user restates its request (first time), then asks the agent to go ahead.
    * After ``max_turns`` replies (if given) it answers ``###STOP###``.
    """

    def __init__(self, instructions=None, max_turns: int | None = None):
        self.max_turns = max_turns
        self.facts: dict[str, object] = {}
        self.turns = 0
        self.opening = ""
        if instructions is not None:
            self.reset(instructions)

    # -------------------------------------------------------------------------------------------- setup
    def reset(self, instructions, opening: str | None = None) -> str:
        f = scenario_fields(instructions)
        self.fields = f
        self.turns = 0
        self._fallbacks = 0
        self.facts = self._parse_facts(f)
        self.opening = opening if opening is not None else self._make_opening(f["reason_for_call"])
        return self.opening

    @staticmethod
    def _make_opening(reason: str) -> str:
        body = to_first_person(_strip_meta(reason)).strip().lstrip(".,;: ")
        body = re.sub(r"\.(?:\s*\.)+", ".", body)
        return f"Hi! {body}" if body else "Hi! I need some help with my account."

    @staticmethod
    def _parse_facts(f: dict[str, str]) -> dict[str, object]:
        known, everything = f["known_info"], " ".join(f.values())
        facts: dict[str, object] = {}
        emails = _EMAIL_RE.findall(known)
        if emails:
            facts["email"] = emails
        user_ids = _USER_ID_RE.findall(known) or _USER_ID_RE.findall(everything)
        if user_ids:
            facts["user_id"] = user_ids[0]
        first = last = None
        for m in _NAME_RE.finditer(known):
            if m.group(1) not in _NOT_NAMES:
                first = m.group(1)
                last = m.group(2) if m.group(2) not in _NOT_NAMES else None
                break
        if user_ids:
            parts = user_ids[0].split("_")[:-1]
            first = first or parts[0].title()
            last = last or (parts[-1].title() if len(parts) > 1 else None)
        if first:
            facts["name"] = f"{first} {last}" if last else first
        zips = _ZIP_RE.findall(known)
        if zips:
            facts["zip"] = zips[0]
        address = _ADDRESS_RE.search(known)
        if address:
            facts["address"] = address.group(0).strip().rstrip(",")
        orders = list(dict.fromkeys("#" + o.lstrip("#") for o in _ORDER_RE.findall(everything)))
        if orders:
            facts["order_id"] = orders
        low = (f["reason_for_call"] + " " + f["task_instructions"]).lower()
        found = sorted((low.find(key), label) for key, label in _PAYMENTS if key in low)
        if found:
            facts["payment"] = found[0][1]
        return facts

    # -------------------------------------------------------------------------------------------- replies
    def _say_fact(self, key: str) -> str:
        v = self.facts[key]
        if key == "email":
            return "My email is " + " or ".join(v) + "."
        if key == "name":
            return f"My name is {v}."
        if key == "zip":
            return f"My zip code is {v}."
        if key == "user_id":
            return f"My user id is {v}."
        if key == "address":
            return f"My address is {v}."
        if key == "order_id":
            return ("The order id is " if len(v) == 1 else "The order ids are ") + " and ".join(v) + "."
        if key == "payment":
            return (
                f"I'd like to use my {v}."
                if v != "original payment method"
                else "Please use the original payment method."
            )
        raise KeyError(key)

    def _unknown(self, key: str, label: str) -> str:
        for s in _sentences(self.fields["unknown_info"]):
            if label.split()[0] in s.lower() or key.replace("_", " ") in s.lower():
                return to_first_person(s).rstrip(".") + "."
        if key == "payment":
            return "Please use the original payment method."
        return f"I'm sorry, I don't know my {label}."

    def respond(self, message: str) -> str:
        self.turns += 1
        if self.max_turns is not None and self.turns > self.max_turns:
            return STOP
        text = str(message)
        if _TRANSFER_RE.search(text):
            return TRANSFER
        if _DONE_RE.search(text):
            return STOP
        low = text.lower()
        confirm = bool(_CONFIRM_RE.search(text))
        low_no_email = low.replace("email address", "email").replace("e-mail address", "email")
        strong, weak = [], []
        for key, (pattern, label, is_strong) in _ASKS.items():
            haystack = low_no_email if key == "address" else low
            if not re.search(pattern, haystack):
                continue
            said = self._say_fact(key) if key in self.facts else self._unknown(key, label)
            (strong if is_strong else weak).append(said)
        for kw in _OTHER_KEYWORDS:
            if kw in low:
                weak += [to_first_person(s) for s in _sentences(self.fields["known_info"]) if kw in s.lower()]
        if confirm:
            return " ".join([*strong, "Yes, please go ahead."])
        if strong or weak:
            return " ".join(dict.fromkeys(strong + weak))
        self._fallbacks += 1
        if self._fallbacks == 1:
            return "To repeat my request: " + self.opening.removeprefix("Hi! ")
        return "Could you please go ahead and help me with my request?"
