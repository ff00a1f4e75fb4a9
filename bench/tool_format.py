"""The demo model taught the tool-call format by SFT on generated episodes, and its valid-call rate
on BFCL's simple (Python) category before and after.

- Episodes: generated here (not BFCL's): a user asks for something one of 1-3 offered functions
  does (weather, currency, bookings, geometry...: 20 kinds, random names, values and wording); the
  assistant calls it with exactly the values asked for, the tool answers, the assistant says the
  result. Imported with `appliance data add` (every call checked against its schema) and trained
  with `appliance finetune run` (LoRA; every assistant turn learned, the tool's answers masked),
  in a state directory of the bench's own.
- Measured on the first N questions of BFCL's simple_python set (the `bfcl-eval` wheel's data,
  installed without its dependencies into the cache): each question shown with its one function in
  the template the pool serves tool calls with (Hermes' format for the demo model), answered
  greedily by the base and by base + adapter (transformers, batched), the answer parsed by vLLM's
  own Hermes parser as the engine would. Three rates: a call is *formed* (parsed, its arguments a
  JSON object), *passes the gateway* (names the offered function, its arguments valid against the
  schema, checked by appliance.tool_schemas as the gateway checks), and is *correct* by BFCL's AST
  checker (function, arguments and values against BFCL's possible answers). Each difference comes
  with its 95 % interval (bootstrap paired by question).

Run: .venv/bin/python -m bench.tool_format [--questions N] [--rows N] [--steps N]   (after ./bootstrap.sh --no-start)
Writes bench/results/tool_format.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

from appliance.home import Home
from appliance.tool_calling import tool_template
from appliance.tool_schemas import argument_problem, checker

RESULTS = Path(__file__).parent / "results" / "tool_format.json"
BFCL = "bfcl-eval==2026.3.23"
APPLIANCE = str(Path(sys.executable).with_name("appliance"))
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Nairobi", "Denver", "Hanoi", "Porto", "Perth", "Quito"]
WORDS = ["report", "invoice", "meeting", "garden", "river", "engine", "lesson", "ticket", "museum", "harbor"]

# Kinds of request: (verb, noun, description, parameters {name: (JSON type, value maker)}, phrasing)
KINDS: list[tuple[str, str, str, dict[str, tuple[str, Any]], list[str]]] = [
    ("get", "weather", "Current weather in a city.", {"city": ("string", lambda r: r.choice(CITIES)),
     "unit": ("string", lambda r: r.choice(["celsius", "fahrenheit"]))},
     ["What is the weather in {city} in {unit}?", "Tell me the {unit} temperature in {city}."]),
    ("convert", "currency", "Convert an amount between currencies.", {"amount": ("number", lambda r: r.randint(2, 900)),
     "from_currency": ("string", lambda r: r.choice(["USD", "EUR", "JPY"])),
     "to_currency": ("string", lambda r: r.choice(["GBP", "CHF", "INR"]))},
     ["Convert {amount} {from_currency} to {to_currency}.", "How much is {amount} {from_currency} in {to_currency}?"]),
    ("book", "table", "Book a restaurant table.",
     {"restaurant": ("string", lambda r: r.choice(WORDS).title() + " Cafe"),
      "people": ("integer", lambda r: r.randint(1, 12))},
     ["Book a table at {restaurant} for {people} people.", "Reserve {restaurant} for a party of {people}."]),
    ("calculate", "circle_area", "Area of a circle.", {"radius": ("number", lambda r: r.randint(1, 50))},
     ["What is the area of a circle with radius {radius}?", "Find the area of a circle of radius {radius}."]),
    ("calculate", "rectangle_perimeter", "Perimeter of a rectangle.",
     {"length": ("integer", lambda r: r.randint(1, 99)), "width": ("integer", lambda r: r.randint(1, 99))},
     ["Perimeter of a rectangle {length} long and {width} wide?",
      "Compute the perimeter for length {length}, width {width}."]),
    ("find", "flights", "Search flights.", {"origin": ("string", lambda r: r.choice(CITIES)),
     "destination": ("string", lambda r: r.choice(CITIES)), "passengers": ("integer", lambda r: r.randint(1, 6))},
     ["Find flights from {origin} to {destination} for {passengers} passengers.",
      "I need {passengers} seats from {origin} to {destination}."]),
    ("get", "stock_price", "Latest price of a stock.",
     {"ticker": ("string", lambda r: r.choice(["ACME", "GLOBX", "INITK"]))},
     ["What is {ticker} trading at?", "Get the stock price of {ticker}."]),
    ("translate", "text", "Translate text.", {"text": ("string", lambda r: "the " + r.choice(WORDS)),
     "language": ("string", lambda r: r.choice(["French", "Hindi", "German"]))},
     ["Translate '{text}' into {language}.", "How do you say '{text}' in {language}?"]),
    ("compute", "factorial", "Factorial of a number.", {"n": ("integer", lambda r: r.randint(2, 20))},
     ["What is {n} factorial?", "Compute the factorial of {n}."]),
    ("get", "distance", "Distance between two cities.", {"city_a": ("string", lambda r: r.choice(CITIES)),
     "city_b": ("string", lambda r: r.choice(CITIES))},
     ["How far is {city_a} from {city_b}?", "Distance between {city_a} and {city_b}, please."]),
    ("set", "alarm", "Set an alarm.", {"hour": ("integer", lambda r: r.randint(0, 23)),
     "minute": ("integer", lambda r: r.randint(0, 59))},
     ["Wake me at {hour}:{minute}.", "Set an alarm for hour {hour}, minute {minute}."]),
    ("search", "recipes", "Recipes with an ingredient.", {"ingredient": ("string", lambda r: r.choice(
        ["rice", "lentils", "tofu", "basil"])), "max_minutes": ("integer", lambda r: r.randint(10, 90))},
     ["Recipes with {ingredient} under {max_minutes} minutes?",
      "Find {ingredient} dishes taking at most {max_minutes} minutes."]),
    ("calculate", "bmi", "Body mass index.", {"weight_kg": ("number", lambda r: r.randint(40, 120)),
     "height_m": ("number", lambda r: round(r.uniform(1.4, 2.1), 2))},
     ["BMI for {weight_kg} kg and {height_m} m?", "Compute my BMI: weight {weight_kg} kg, height {height_m} m."]),
    ("get", "population", "Population of a country in a year.", {"country": ("string", lambda r: r.choice(
        ["Peru", "Kenya", "Norway", "Japan"])), "year": ("integer", lambda r: r.randint(1950, 2020))},
     ["What was the population of {country} in {year}?", "Population of {country}, year {year}."]),
    ("convert", "temperature", "Convert a temperature.", {"value": ("number", lambda r: r.randint(-40, 120)),
     "to_unit": ("string", lambda r: r.choice(["kelvin", "celsius"]))},
     ["Convert {value} degrees to {to_unit}.", "What is {value} degrees in {to_unit}?"]),
    ("send", "message", "Send a message.", {"to": ("string", lambda r: r.choice(["Ana", "Li", "Omar"])),
     "subject": ("string", lambda r: "The " + r.choice(WORDS))},
     ["Email {to} with subject '{subject}'.", "Send a message to {to} titled '{subject}'."]),
    ("calculate", "compound_interest", "Compound interest.",
     {"principal": ("number", lambda r: r.randint(100, 9000)),
     "rate": ("number", lambda r: r.choice([0.02, 0.05, 0.07])), "years": ("integer", lambda r: r.randint(1, 30))},
     ["Interest on {principal} at {rate} for {years} years?",
      "Compound {principal} at rate {rate} over {years} years."]),
    ("get", "movie_times", "Showtimes of a film.", {"title": ("string", lambda r: "The " + r.choice(WORDS).title()),
     "city": ("string", lambda r: r.choice(CITIES))},
     ["When is {title} showing in {city}?", "Showtimes for {title} in {city}."]),
    ("count", "words", "Count the words of a text.", {"text": ("string", lambda r: " ".join(r.sample(WORDS, 3)))},
     ["How many words are in '{text}'?", "Count the words: '{text}'."]),
    ("solve", "linear_equation", "Solve a*x + b = 0.", {"a": ("integer", lambda r: r.randint(1, 9)),
     "b": ("integer", lambda r: r.randint(-20, 20))},
     ["Solve {a}x + {b} = 0.", "Find x where a = {a} and b = {b} in a*x + b = 0."]),
]


def function(kind: tuple[str, str, str, dict[str, tuple[str, Any]], list[str]], draw: random.Random) -> dict[str, Any]:
    verb, noun, description, parameters, _ = kind
    name = draw.choice([f"{verb}_{noun}", f"{noun}.{verb}", f"{verb}{noun.title().replace('_', '')}"])
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {p: {"type": t, "description": p.replace("_", " ")}
                                         for p, (t, _) in parameters.items()},
        "required": list(parameters)}}}


def episodes(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Generated tool-calling episodes: one call of one of 1-3 offered functions, its answer, the result said."""
    draw = random.Random(seed)
    rows = []
    for _ in range(count):
        kinds = draw.sample(KINDS, draw.randint(1, 3))
        offered = [function(kind, draw) for kind in kinds]
        chosen = draw.randrange(len(kinds))
        values = {p: make(draw) for p, (_, make) in kinds[chosen][3].items()}
        question = draw.choice(kinds[chosen][4]).format(**values)
        name = offered[chosen]["function"]["name"]
        result = json.dumps({"result": draw.randint(1, 999), "status": "ok"})
        rows.append({"tools": offered, "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(values)}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": f"Done: {result}."}]})
    return rows


def bfcl(cache: Path) -> Path:
    """The bfcl-eval package (its data and AST checker), installed without its dependencies."""
    target = cache / "bfcl-eval"
    if not (target / "bfcl_eval").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), BFCL],
                       check=True)
    return target


def ast_checker(target: Path) -> Any:
    """BFCL's AST checker without its model handlers (which import every vendor's SDK): only
    their config's `underscore_to_dot`, False here (names are kept as the function has them)."""
    sys.path.insert(0, str(target))
    config = types.ModuleType("bfcl_eval.constants.model_config")
    config.MODEL_CONFIG_MAPPING = {"appliance": types.SimpleNamespace(underscore_to_dot=False)}  # type: ignore[attr-defined]
    sys.modules["bfcl_eval.constants.model_config"] = config
    from bfcl_eval.constants.enums import Language  # type: ignore[import-not-found]  # installed at run time
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker as check  # type: ignore[import-not-found]

    return lambda functions, output, answers: check(functions, output, answers, Language.PYTHON, "simple",
                                                    "appliance")["valid"]


def openai_schema(value: Any) -> Any:
    """BFCL's parameter types as JSON Schema's (dict, float, tuple, any)."""
    if isinstance(value, dict):
        found = {k: openai_schema(v) for k, v in value.items()}
        kind = value.get("type")
        if kind in ("dict", "float", "tuple", "any"):
            found.pop("type")
            if kind != "any":
                found["type"] = {"dict": "object", "float": "number", "tuple": "array"}[kind]
        return found
    return [openai_schema(v) for v in value] if isinstance(value, list) else value


def questions(target: Path, count: int) -> list[dict[str, Any]]:
    data = target / "bfcl_eval" / "data"
    asked = [json.loads(line) for line in (data / "BFCL_v4_simple_python.json").read_text().splitlines()[:count]]
    answers = {a["id"]: a["ground_truth"] for a in map(json.loads, (data / "possible_answer" /
                                                                      "BFCL_v4_simple_python.json").read_text().splitlines())}
    return [{"id": q["id"], "messages": q["question"][0], "functions": q["function"], "answer": answers[q["id"]],
             "tools": [{"type": "function", "function": {**f, "parameters": openai_schema(f["parameters"])}}
                       for f in q["function"]]} for q in asked]


def answered(model: Any, tokenizer: Any, template: str, asked: list[dict[str, Any]], batch: int = 16) -> list[str]:
    import torch

    texts = []
    for start in range(0, len(asked), batch):
        prompts = [tokenizer.apply_chat_template(q["messages"], tools=q["tools"], chat_template=template,
                                                 add_generation_prompt=True, tokenize=False)
                   for q in asked[start:start + batch]]
        encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**encoded, max_new_tokens=64, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"  answered {len(texts)}/{len(asked)}", file=sys.stderr, flush=True)
    return texts


def scored(texts: list[str], asked: list[dict[str, Any]], parser: Any, correct: Any) -> list[dict[str, bool]]:
    found = []
    for text, question in zip(texts, asked, strict=True):
        calls = parser.extract_tool_calls(text, None).tool_calls
        arguments = [json.loads(c.function.arguments) if _object(c.function.arguments) else None for c in calls]
        formed = bool(calls) and all(a is not None for a in arguments)
        offered = {t["function"]["name"]: checker(t["function"]["parameters"], "parameters") for t in question["tools"]}
        gateway = formed and all(c.function.name in offered and argument_problem(
            offered[c.function.name], c.function.name, c.function.arguments) is None for c in calls)
        output = [{c.function.name: a} for c, a in zip(calls, arguments, strict=True)]
        right = formed and correct(question["functions"], output, question["answer"])
        found.append({"formed": formed, "gateway": gateway, "correct": bool(right)})
    return found


def _object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def paired(before: list[bool], after: list[bool], resamples: int = 2000) -> dict[str, float]:
    gains = [float(a) - float(b) for a, b in zip(after, before, strict=True)]
    draw = random.Random(0)
    means = sorted(statistics.fmean(draw.choices(gains, k=len(gains))) for _ in range(resamples))
    return {"before": round(statistics.fmean(map(float, before)), 3),
            "after": round(statistics.fmean(map(float, after)), 3),
            "difference": round(statistics.fmean(gains), 3), "low": round(means[int(0.025 * resamples)], 3),
            "high": round(means[int(0.975 * resamples)], 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--rows", type=int, default=400)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    demo = Home.from_env().demo_model
    target = bfcl(Home.from_env().cache)
    correct = ast_checker(target)
    asked = questions(target, args.questions)

    with tempfile.TemporaryDirectory(prefix="tool-format-") as work:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")},
               "APPLIANCE_HOME": str(Path(work) / "home"), "APPLIANCE_FINETUNE__REGRESSION_SET": "none"}
        rows = Path(work) / "episodes.jsonl"
        rows.write_text("".join(json.dumps(r) + "\n" for r in episodes(args.rows)))
        added = subprocess.run([APPLIANCE, "data", "add", str(rows), "--name", "tool-format", "--model", str(demo)],
                               env=env, capture_output=True, text=True)
        assert added.returncode == 0, added.stdout + added.stderr
        started = time.monotonic()
        trained = subprocess.run([APPLIANCE, "finetune", "run", "--data", "tool-format", "--base", str(demo),
                                  "--name", "tool-format", "--max-steps", str(args.steps), "--batch-size", "2",
                                  "--lr", "0.001", "--max-length", "1024"], env=env, capture_output=True, text=True)
        train_s = time.monotonic() - started
        print(trained.stdout[-1500:], file=sys.stderr)
        [job] = (Path(work) / "home" / "finetune").glob("tool-format-*")
        adapter = job / "adapter"
        assert (adapter / "adapter_config.json").is_file(), trained.stdout + trained.stderr
        result = json.loads((job / "result.json").read_text())

        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        tokenizer = AutoTokenizer.from_pretrained(demo, padding_side="left")
        template = tool_template(demo)
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo), str(adapter)).eval()
        with model.disable_adapter():
            base_texts = answered(model, tokenizer, template, asked)
        tuned_texts = answered(model, tokenizer, template, asked)
    hermes = Hermes2ProToolParser(tokenizer)  # type: ignore[arg-type]  # a transformers tokenizer is what it takes
    before, after = scored(base_texts, asked, hermes, correct), scored(tuned_texts, asked, hermes, correct)
    figures = {rate: paired([b[rate] for b in before], [a[rate] for a in after])
               for rate in ("formed", "gateway", "correct")}
    report = {"model": demo.name, "questions": len(asked), "bfcl": BFCL, "category": "simple_python",
              "training": {"rows": args.rows, "steps": result["steps"], "batch_size": 2, "seconds": round(train_s),
                           "held_out_loss": [round(result["base_eval_loss"], 3), round(result["adapter_eval_loss"], 3)],
                           "gate": "passed" if trained.returncode == 0 else "failed"},
               "rates": figures, "examples": {"base": base_texts[:3], "adapter": tuned_texts[:3]}}
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "examples"}, indent=1))


if __name__ == "__main__":
    main()
