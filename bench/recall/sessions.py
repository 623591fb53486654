"""Generated agent sessions whose question is answered by a tool output many turns back.

A session is a seeded script: a system prompt with four tools, a user task, then steps of one tool
call and its output, and a last user message with the question. Outputs come in four shapes, each
a list of items with distractors of the same shape (same fields, other ids and values):
- `orders`: JSON API records (`get_orders`), one per line: order id, customer id, item, city, total, status;
- `logs`: service log lines (`search_logs`): time, request id, user id, status code, latency;
- `files`: directory listings (`list_files`), a table: name, owner, size, date;
- `search`: search snippets (`web_search`): numbered results with a title, a fact and a source.
The question names one item and asks for one exact value of it. With `hops` 2 or 3 the value is
reached through other outputs, one question per hop as an agent takes them, each earlier hop
asked and answered (gold) before the last: which user made a request (a log line), the city of
that user's order (an order record), the founding year of a place in that city (a search result).
The 0.5B default model answers almost none of them when asked to chain the hops in one question.
A one-hop session asks one question before the last, about the latest output that holds no
needle, answered (gold): every session ends on an answered question before its own, as the
multi-hop ones do (on the default model this took one-hop accuracy at 2k from 5 to 9 of 12,
the same sessions). `depth` places the first hop's output at that share of the session's steps
(later hops follow it in order). Lengths are reached by the number of steps, each output about
100-150 tokens.

An item is named by a key that no other item of the session shares a word with: order ids,
request ids, customer ids and file names each take a word from `KEYS` that the session uses
once. Keys built from a few short lists (colour-animal ids, hex request ids) left near-duplicates
among the dozens of items of a 2k session, and the small model answered from the neighbour.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

SYSTEM = (
    "You are an operations assistant. Use the tools to look things up. When the user asks a question, "
    "answer with the exact value from the tool outputs, and nothing else."
)
TASK = "I am auditing our systems today. Fetch what I ask for and keep it at hand; I will ask questions at the end."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": arg_desc}},
                "required": [arg],
            },
        },
    }
    for name, desc, arg, arg_desc in (
        ("get_orders", "Order records of a region, as JSON.", "region", "a sales region"),
        ("search_logs", "Log lines of a service.", "service", "a service name"),
        ("list_files", "A directory listing.", "path", "a directory"),
        ("web_search", "Web search results.", "query", "what to search for"),
    )
]
TOOL_OF = {"orders": "get_orders", "logs": "search_logs", "files": "list_files", "search": "web_search"}
ARGUMENT_OF = {t["function"]["name"]: t["function"]["parameters"]["required"][0] for t in TOOLS}
FIRST = [
    "Dana",
    "Omar",
    "Lena",
    "Ravi",
    "Mia",
    "Tomas",
    "Aiko",
    "Jonas",
    "Priya",
    "Karl",
    "Ines",
    "Yusuf",
    "Nora",
    "Pablo",
    "Sofia",
    "Liam",
]
LAST = [
    "Whitfield",
    "Haddad",
    "Novak",
    "Iyer",
    "Larsen",
    "Moreau",
    "Tanaka",
    "Berg",
    "Rao",
    "Meyer",
    "Costa",
    "Demir",
    "Quinn",
    "Ortiz",
]
CITIES = [
    "Lisbon",
    "Porto",
    "Lyon",
    "Graz",
    "Utrecht",
    "Tampere",
    "Bergen",
    "Gdansk",
    "Bilbao",
    "Trieste",
    "Aarhus",
    "Brno",
    "Cork",
    "Malmo",
]
ITEMS = [
    "standing desk",
    "usb hub",
    "monitor arm",
    "webcam",
    "desk lamp",
    "keyboard",
    "headset",
    "router",
    "dock",
    "ssd",
]
STATUS = ["shipped", "pending", "returned", "cancelled", "delivered"]
SERVICES = ["api-gateway", "billing", "auth", "search", "checkout", "notifications", "inventory", "reports"]
REGIONS = ["north", "south", "east", "west", "central", "coastal", "alpine", "islands"]
WORDS = [
    "alpha",
    "beta",
    "ledger",
    "q3",
    "draft",
    "final",
    "backup",
    "export",
    "summary",
    "invoice",
    "audit",
    "notes",
    "plan",
]
TOPICS = [
    "company",
    "bridge",
    "observatory",
    "festival",
    "library",
    "railway",
    "museum",
    "stadium",
    "harbour",
    "university",
]
KEYS = """apricot birch cedar dahlia ember falcon garnet harbor iris juniper kestrel lagoon maple nectar onyx
pepper quartz raven saffron thistle umber velvet willow yarrow zephyr acorn basil clover dune elm fern glacier hazel
indigo jasmine kelp lotus mango nutmeg oak pebble quill reed sage tulip violet walnut almond bramble canyon delta
ebony fjord gorse heather ivy jade kale lily moss nettle olive pine quince rowan spruce tansy vale wheat yew alder
bay cobalt daisy fig ginger holly islet jet kiwi larch mint nova orchid plum rye sorrel teak upland vetch wren
amber blossom coral dove echo flint grove hickory inlet jasper krill laurel marble nimbus opal poplar ridge slate
topaz valley willet yucca aspen beacon cliff drift fennel granite hemlock iceberg juno kingfisher
lichen meadow""".split()
SHAPES = ("orders", "logs", "files", "search")
# with tools offered, the small models call one instead of answering unless told
ANSWER_ONLY = " Do not call a tool: reply with the value only."


@dataclass
class Session:
    seed: int
    shape: str
    hops: int
    depth: float
    messages: list[dict]  # system, user task, (assistant call, tool output) per step, the question
    answer: str
    needed_steps: list[int] = field(default_factory=list)  # the steps whose outputs hold the hops


class Ids:
    """Unique ids within one session, so a distractor never shares the needle's id, and key words
    that each name one item of the session (a second round suffixes them: "fern2")."""

    def __init__(self, rng: random.Random):
        self.rng, self.used, self.rounds, self.words = rng, set(), 0, []

    def word(self) -> str:
        if not self.words:
            self.rounds += 1
            self.words = [w + (str(self.rounds) if self.rounds > 1 else "") for w in KEYS]
            self.rng.shuffle(self.words)
        return self.words.pop()

    def make(self, fmt) -> str:
        while True:
            v = fmt(self.rng)
            if v not in self.used:
                self.used.add(v)
                return v


def _order(rng, ids: Ids, customer: str | None = None) -> dict:
    # the fields a question looks up follow the field it names: the item the order id, the city the customer
    # ids of words, not digits: the 0.5B default model tells five-digit ids apart badly (measured)
    return {
        "order_id": f"ORD-{ids.word()}",
        "item": rng.choice(ITEMS),
        "customer_id": customer or f"cust-{ids.word()}",
        "city": rng.choice(CITIES),
        "total": f"{rng.randrange(5, 900)}.{rng.randrange(10, 99)}",
        "status": rng.choice(STATUS),
    }


def _log(rng, ids: Ids, service: str, user: str | None = None) -> dict:
    return {
        "time": f"2024-0{rng.randrange(1, 9)}-{rng.randrange(10, 28)}"
        f"T{rng.randrange(10, 23)}:{rng.randrange(10, 59)}:{rng.randrange(10, 59)}Z",
        "request": f"R-{ids.word()}",
        "user": user or f"cust-{ids.word()}",
        "status": str(rng.choice([200, 200, 200, 201, 204, 301, 400, 401, 403, 404, 409, 429, 500, 502, 503])),
        "latency": str(rng.randrange(3, 2400)),
        "service": service,
    }


def _file(rng, ids: Ids) -> dict:
    name = f"{ids.word()}_{rng.choice(WORDS)}.{rng.choice(['pdf', 'csv', 'txt', 'xlsx'])}"
    return {
        "name": name,
        "owner": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
        "size": str(rng.randrange(100, 9999)),
        "date": f"{rng.choice(['Jan', 'Feb', 'Mar', 'Apr', 'May', 'Jun'])} {rng.randrange(10, 28)} "
        f"{rng.randrange(10, 23)}:{rng.randrange(10, 59)}",
    }


def _snippet(rng, ids: Ids, city: str | None = None) -> dict:
    subject = ids.make(lambda r: f"the {city or r.choice(CITIES)} {r.choice(TOPICS)}")
    return {
        "subject": subject,
        "year": str(rng.randrange(1820, 2015)),
        "source": f"{rng.choice(WORDS)}{rng.choice(['.org', '.net', '.com'])}",
        "title": f"History of {subject}",
    }


def render(shape: str, items: list[dict]) -> str:
    if shape == "orders":
        return "[\n" + ",\n".join(json.dumps(i) for i in items) + "\n]"  # a record per line
    if shape == "logs":
        return "\n".join(
            f"{i['time']} {i['service']} req={i['request']} user={i['user']} status={i['status']} "
            f"latency_ms={i['latency']}"
            for i in items
        )
    if shape == "files":
        return "| name | owner | size_bytes | modified |\n" + "\n".join(
            f"| {i['name']} | {i['owner']} | {i['size']} | {i['date']} |" for i in items
        )
    return "\n".join(
        f"[{n + 1}] {i['title']} - {i['subject'][0].upper() + i['subject'][1:]} was founded in {i['year']}. "
        f"({i['source']})"
        for n, i in enumerate(items)
    )


def _item(shape: str, rng, ids: Ids, service: str = "") -> dict:
    """One item of the shape (a log line's service is its step's, set where it is placed)."""
    if shape == "orders":
        return _order(rng, ids)
    if shape == "logs":
        return _log(rng, ids, service)
    return _file(rng, ids) if shape == "files" else _snippet(rng, ids)


def _step(shape: str, rng, ids: Ids, n: int, needles: list[dict] = ()) -> tuple[dict, list[dict]]:
    """One tool call and its output's items: n of the shape, the needles among them at random places."""
    arg = {
        "orders": rng.choice(REGIONS),
        "logs": rng.choice(SERVICES),
        "files": f"/data/{rng.choice(WORDS)}",
        "search": rng.choice(TOPICS),
    }[shape]
    items = [_item(shape, rng, ids, arg) for _ in range(n - len(needles))]
    for needle in needles:
        if shape == "logs":
            needle["service"] = arg
        items.insert(rng.randrange(len(items) + 1), needle)
    name = TOOL_OF[shape]
    return {"name": name, "arguments": {ARGUMENT_OF[name]: arg}}, items


def ask(shape: str, item: dict) -> tuple[str, str]:
    """The one-hop question that names the item by its key, and its answer."""
    if shape == "orders":
        return f'Which item was bought in order "{item["order_id"]}"?', item["item"]
    if shape == "logs":
        return f"Which user made the request with req={item['request']}?", item["user"]
    if shape == "files":
        return f"Who owns the file {item['name']}?", item["owner"]
    return f"According to the search results, in what year was {item['subject']} founded?", item["year"]


ITEMS_PER_OUTPUT = {"orders": 2, "logs": 2, "files": 2, "search": 2}


def generate(seed: int, steps: int, shape: str, hops: int, depth: float) -> Session:
    """A session of `steps` tool steps; the question's first hop at step round(depth * (steps - hops))."""
    rng = random.Random(f"{seed}-{steps}-{shape}-{hops}-{depth}")
    ids = Ids(rng)
    at = min(steps - hops, round(depth * (steps - hops)))
    needles: dict[int, tuple[str, list[dict]]] = {}
    if hops == 1:
        item = _item(shape, rng, ids)
        question, answer = ask(shape, item)
        needles[at] = (shape, [item])
        chain = [(question, answer)]
    else:  # a log line names a user, that user's order a city, a search result about the city a year
        user = f"cust-{ids.word()}"
        log = _log(rng, ids, "", user)
        order = _order(rng, ids, customer=user)
        needles[at] = ("logs", [log])
        needles[at + 1] = ("orders", [order])
        chain = [ask("logs", log), (f'In which city is the order of customer "{user}"?', order["city"])]
        if hops == 3:
            snippet = _snippet(rng, ids, order["city"])
            needles[at + 2] = ("search", [snippet])
            chain.append(ask("search", snippet))
        question, answer = chain[-1]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    needed, outputs = [], []
    for s in range(steps):
        kind, planted = needles.get(s) or (rng.choice(SHAPES), [])
        if planted:
            needed.append(s)
        call, items = _step(kind, rng, ids, ITEMS_PER_OUTPUT[kind], planted)
        outputs.append((kind, items))
        cid = f"call_{s}"
        messages.append(
            {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function", "function": call}]}
        )
        messages.append({"role": "tool", "tool_call_id": cid, "content": render(kind, items)})
    if hops == 1:  # the warm-up: the latest needle-free output's first item whose answer is not the gold one
        asked = [
            ask(kind, item)
            for s, (kind, items) in reversed(list(enumerate(outputs)))
            if s not in needed
            for item in items
        ]
        chain.insert(0, next(qa for qa in asked if qa[1] != answer))
    # the earlier questions as the agent takes them: asked, and answered (gold), before the last
    for q, a in chain[:-1]:
        messages += [{"role": "user", "content": q + ANSWER_ONLY}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": question + ANSWER_ONLY})
    return Session(seed, shape, hops, depth, messages, answer, needed)


def normalise(text: str) -> str:
    for c in "\"'`$,.:;!?()[]{}":
        text = text.replace(c, " ")
    return " ".join(text.lower().split())


def correct(prediction: str, answer: str) -> bool:
    """The value, as whole words, in a short reply (at most three other words: a reply that lists
    several candidates does not count)."""
    p, a = normalise(prediction).split(), normalise(answer).split()
    return len(p) <= len(a) + 3 and any(p[i : i + len(a)] == a for i in range(len(p) - len(a) + 1))
