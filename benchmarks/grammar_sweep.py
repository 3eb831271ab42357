"""The structured-output sweep: many JSON Schemas, each answered greedily and with three seeds,
every reply that ends with "stop" parsed and validated (jsonschema).

    python -m benchmarks.grammar_sweep [--max-tokens 256] [--json FILE] [--model SRC]

Too long for the test suite (tests/test_grammar.py keeps a few of these); run it before
changing the grammar stage. Prints one line per schema and the totals: how many replies
ended with "stop", and how many of those validate (must be all).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.common import on_threads


def _object(properties: dict, **more) -> dict:
    """An object schema with every property required, in their order; `more`: its other keys."""
    return {"type": "object", "properties": properties, "required": list(properties), **more}


# 24 schemas, from flat to hard: nested objects, arrays with minItems/maxItems, enums, numbers
# with bounds, optional fields, $ref/$defs, patterns, formats, anyOf, const.
SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": (
        "Describe a person.",
        _object({"name": {"type": "string"}, "age": {"type": "integer"}}),
    ),
    "bounded-number": (
        "Rate this movie from 1 to 10 and say why.",
        _object(
            {
                "score": {"type": "number", "minimum": 1, "maximum": 10},
                "reason": {"type": "string", "maxLength": 80},
            },
            additionalProperties=False,
        ),
    ),
    "enum": (
        "What is the weather like today?",
        _object(
            {
                "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                "temperature_c": {"type": "integer", "minimum": -50, "maximum": 60},
            }
        ),
    ),
    "array-bounds": (
        "List some fruits with their colours.",
        _object(
            {
                "fruits": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": _object({"name": {"type": "string"}, "colour": {"type": "string"}}),
                }
            }
        ),
    ),
    "nested": (
        "Describe a company and its address.",
        _object(
            {
                "company": {"type": "string"},
                "address": _object(
                    {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    }
                ),
                "employees": {"type": "integer", "minimum": 1},
            }
        ),
    ),
    "optional-fields": (
        "Tell me about a book.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "author": {"type": "string"},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "series": {"type": "string"},
            },
            "required": ["title", "author"],
        },
    ),
    "refs": (
        "Write an order with a few items.",
        {
            "$defs": {
                "item": _object(
                    {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                        "price": {"type": "number", "minimum": 0},
                    }
                )
            },
            **_object(
                {
                    "order_id": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/item"},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                }
            ),
        },
    ),
    "recursive-ref": (
        "Describe a small family tree.",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 20},
                        "children": {
                            "type": "array",
                            "maxItems": 2,
                            "items": {"$ref": "#/$defs/node"},
                        },
                    },
                    "required": ["name"],
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    "booleans": (
        "Is water wet? Is fire cold? Answer both.",
        _object({"water_wet": {"type": "boolean"}, "fire_cold": {"type": "boolean"}}),
    ),
    "string-lengths": (
        "Give a username and a short bio.",
        _object(
            {
                "username": {
                    "type": "string",
                    "minLength": 3,
                    "maxLength": 12,
                    "pattern": "^[a-z0-9_]+$",
                },
                "bio": {"type": "string", "maxLength": 60},
            }
        ),
    ),
    "const-and-anyof": (
        "Describe a shape.",
        _object(
            {
                "version": {"const": 1},
                "shape": {
                    "anyOf": [
                        _object(
                            {
                                "kind": {"const": "circle"},
                                "radius": {"type": "number", "minimum": 0},
                            }
                        ),
                        _object(
                            {
                                "kind": {"const": "square"},
                                "side": {"type": "number", "minimum": 0},
                            }
                        ),
                    ]
                },
            }
        ),
    ),
    "formats": (
        "Give a contact: email, a date and a website.",
        _object(
            {
                "email": {"type": "string", "format": "email"},
                "date": {"type": "string", "format": "date"},
                "site": {"type": "string", "format": "uri"},
            }
        ),
    ),
    "list-of-strings": (
        "Name three planets.",
        {
            "type": "array",
            "items": {"type": "string", "maxLength": 20},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    "matrix": (
        "Give a 2x2 matrix of small integers.",
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "integer", "minimum": -9, "maximum": 9},
            },
        },
    ),
    "event": (
        "Plan a meeting.",
        _object(
            {
                "title": {"type": "string", "maxLength": 40},
                "start": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                "minutes": {"type": "integer", "enum": [15, 30, 45, 60]},
                "attendees": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 20},
                    "minItems": 1,
                    "maxItems": 4,
                },
            },
            additionalProperties=False,
        ),
    ),
    "recipe": (
        "Give me a simple recipe.",
        _object(
            {
                "name": {"type": "string", "maxLength": 40},
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 5,
                    "items": _object(
                        {
                            "item": {"type": "string", "maxLength": 20},
                            "grams": {"type": "integer", "minimum": 1, "maximum": 2000},
                        }
                    ),
                },
                "vegetarian": {"type": "boolean"},
            }
        ),
    ),
    "sentiment": (
        "Classify: 'I loved this film, the acting was superb.'",
        _object(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
    ),
    "extraction": (
        "Extract: 'Alice (34) lives in Paris and works as a nurse.'",
        _object(
            {
                "name": {"type": "string"},
                "age": {"type": "integer", "minimum": 0, "maximum": 130},
                "city": {"type": "string"},
                "job": {"type": ["string", "null"]},
            }
        ),
    ),
    "nullable-union": (
        "Describe a pet, if any.",
        _object(
            {
                "has_pet": {"type": "boolean"},
                "pet": {
                    "anyOf": [
                        {"type": "null"},
                        {
                            "type": "object",
                            "properties": {
                                "species": {"type": "string"},
                                "age": {"type": "integer", "minimum": 0},
                            },
                            "required": ["species"],
                        },
                    ]
                },
            }
        ),
    ),
    "deep-nesting": (
        "Describe a school.",
        _object(
            {
                "school": _object(
                    {
                        "name": {"type": "string", "maxLength": 30},
                        "classes": {
                            "type": "array",
                            "maxItems": 2,
                            "items": _object(
                                {
                                    "teacher": _object(
                                        {
                                            "name": {"type": "string", "maxLength": 20},
                                            "subject": {
                                                "enum": ["math", "art", "science", "music"]
                                            },
                                        }
                                    ),
                                    "students": {"type": "integer", "minimum": 1, "maximum": 40},
                                }
                            ),
                        },
                    }
                )
            }
        ),
    ),
    "integer-multiple": (
        "Pick a price in cents, a multiple of 5.",
        _object({"cents": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 10000}}),
    ),
    "tags": (
        "Tag this article: 'New battery doubles electric car range.'",
        _object(
            {
                "tags": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {"enum": ["science", "cars", "energy", "politics", "sports", "tech"]},
                }
            }
        ),
    ),
    "key-value-map": (
        "Give the population of three cities (in millions).",
        {
            "type": "object",
            "additionalProperties": {"type": "number", "minimum": 0},
            "minProperties": 1,
            "maxProperties": 3,
        },
    ),
    "product": (
        "Describe a laptop for sale.",
        {
            "type": "object",
            "properties": {
                "brand": {"type": "string", "maxLength": 20},
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "specs": {
                    "type": "object",
                    "properties": {
                        "ram_gb": {"enum": [8, 16, 32, 64]},
                        "storage_gb": {"type": "integer", "minimum": 128, "maximum": 4096},
                        "touchscreen": {"type": "boolean"},
                    },
                    "required": ["ram_gb", "storage_gb"],
                },
                "colors": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 12},
                    "maxItems": 3,
                },
            },
            "required": ["brand", "price", "specs"],
        },
    ),
}
SEEDS = (1, 2, 3)


def run_sweep(
    engine, max_tokens: int = 256, repetition_penalty: float = 1.0, progress=print, sampled=None
) -> dict:
    """Every schema greedy and with each seed, the four replies of a schema as one batch.
    `sampled`: the seeded runs' settings (default temperature 0.8, top-k 50, top-p 0.95);
    the greedy run takes its repetition penalty."""
    import jsonschema

    from miniserve.core.config import Constraint, SamplingParams
    from miniserve.engine.chat import render

    sampled = sampled or SamplingParams(
        temperature=0.8, top_p=0.95, repetition_penalty=repetition_penalty
    )
    repetition_penalty = sampled.repetition_penalty
    rows = []
    for name, (question, schema) in SCHEMAS.items():
        constraint = Constraint("json_schema", json.dumps(schema))
        prompt = render(
            engine.tokenizer,
            [  # as users do: the schema in the prompt too
                {
                    "role": "system",
                    "content": "Answer with JSON that follows this JSON Schema: "
                    + json.dumps(schema),
                },
                {"role": "user", "content": question},
            ],
        )
        settings = [
            SamplingParams(
                temperature=0,
                max_new_tokens=max_tokens,
                repetition_penalty=repetition_penalty,
                constraint=constraint,
            )
        ] + [
            sampled.replace(seed=s, max_new_tokens=max_tokens, constraint=constraint) for s in SEEDS
        ]

        def one(i):  # noqa: B023 -- each thread is joined in this iteration
            chunks = list(engine.complete(prompt, settings[i], reuse_prefix=False))  # noqa: B023
            return "".join(c.text for c in chunks), chunks[-1].stats

        started = time.perf_counter()
        results = on_threads(len(settings), one)
        for label, (text, stats) in zip(["greedy", *[f"seed {s}" for s in SEEDS]], results):
            valid, error = None, ""
            if stats.finish_reason in ("stop", "eos"):
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid = True
                except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                    valid, error = False, str(e).splitlines()[0][:120]
            rows.append(
                {
                    "schema": name,
                    "run": label,
                    "finish_reason": stats.finish_reason,
                    "new_tokens": stats.new_tokens,
                    "valid": valid,
                    "error": error,
                    "text": text,
                }
            )
        done = [r for r in rows if r["schema"] == name]
        progress(
            f"{name:18s} "
            + "  ".join(
                f"{r['run']}: {r['finish_reason']}{'' if r['valid'] is not False else ' INVALID'}"
                f" ({r['new_tokens']})"
                for r in done
            )
            + f"  [{time.perf_counter() - started:.1f} s]"
        )
    stopped = [r for r in rows if r["finish_reason"] in ("stop", "eos")]
    return {
        "schemas": len(SCHEMAS),
        "replies": len(rows),
        "stopped": len(stopped),
        "stop_share": len(stopped) / len(rows),
        "valid_of_stopped": sum(1 for r in stopped if r["valid"]) / max(len(stopped), 1),
        "invalid": [r for r in stopped if not r["valid"]],
        "max_tokens": max_tokens,
        "repetition_penalty": repetition_penalty,
        "sampled": {k: v for k, v in sampled.as_dict().items() if k != "seed"},
        "rows": rows,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.grammar_sweep",
        description="JSON Schemas, greedy and seeded: do the replies that end validate?",
    )
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="for every run (1 = off; the app's balanced preset uses 1.1)",
    )
    p.add_argument(
        "--preset",
        default=None,
        help="the seeded runs use this preset of presets.yaml (the greedy run its "
        "repetition penalty); default: temperature 0.8, top-p 0.95",
    )
    p.add_argument("--json", default=None, help="write every reply and the totals here")
    p.add_argument("--model", default=None)
    args = p.parse_args(argv)
    from miniserve.core.platform import cpu_model
    from miniserve.engine.engine import start_engine

    engine = start_engine(args.model)
    sampled = None
    if args.preset:
        from miniserve.core.config import load_presets

        sampled = load_presets()[args.preset]
    result = run_sweep(engine, args.max_tokens, args.repetition_penalty, sampled=sampled)
    result["cpu"] = cpu_model()
    print(
        f"\n{result['schemas']} schemas x {1 + len(SEEDS)} runs = {result['replies']} replies "
        f"(max_tokens {args.max_tokens}, repetition penalty {result['repetition_penalty']:g}"
        f"{', preset ' + args.preset if args.preset else ''}) on "
        f"{result['cpu']}: {result['stopped']} ended "
        f"with stop ({result['stop_share']:.0%}); {result['valid_of_stopped']:.0%} of those "
        f"validate"
    )
    for r in result["invalid"]:
        print(f"  INVALID {r['schema']} {r['run']}: {r['error']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)
    engine.close()
    return 0 if result["valid_of_stopped"] == 1.0 and result["stop_share"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
