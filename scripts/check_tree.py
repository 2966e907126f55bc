#!/usr/bin/env python3
# Copyright kvferry authors. Apache-2.0.
"""Keeps the tree a product: exits 1 when a tracked file or directory is named after a
development step ("stop" and a number, with or without "_" or "-" between), when a tracked
markdown file mentions one ("Stop" or "stop", an optional space, "_" or "-", one to three digits,
as whole words: MENTION below) in a heading or in its body text outside fenced code blocks, when a
tracked script under scripts/ (*.py, *.sh) mentions one on any line (comments and docstrings
included), when a JSON file under bench/results has a field named like "stop" or "session", or
when a marked table of README.md / docs/*.md disagrees with bench/results
(scripts/docs_tables.py --check). Provenance belongs in bench/results (each row's date and
commit), not in a development step's number.

Usage: python3 scripts/check_tree.py   (from anywhere in the checkout; standard library only)
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"stop[_-]?[0-9]", re.I)
HEADING = re.compile(r"^#{1,6}\s.*\bstop\s*[0-9]", re.I)
MENTION = re.compile(r"\b[Ss]top[ _-]?[0-9]{1,3}\b")
FIELD = re.compile(r"stop|session", re.I)


def tracked():
    try:
        out = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True).stdout
        return [p for p in out.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file under ROOT
        files = []
        for d, dirs, fs in os.walk(ROOT):
            dirs[:] = [x for x in dirs if not x.startswith(".") and not x.startswith("build")]
            files += [os.path.relpath(os.path.join(d, f), ROOT) for f in fs]
        return files


def json_fields(obj, path, bad):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if FIELD.search(k):
                bad.append(f"{path}/{k}")
            json_fields(v, f"{path}/{k}", bad)
    elif isinstance(obj, list):
        for v in obj:
            json_fields(v, path, bad)


def main():
    errors = []
    files = tracked()
    for p in files:
        if not os.path.exists(os.path.join(ROOT, p)):
            continue  # deleted in the work tree
        for part in p.split("/"):
            if NAME.search(part):
                errors.append(f"{p}: name after a development step ('{part}')")
                break
        if p.endswith(".md"):
            in_code = False
            with open(os.path.join(ROOT, p), errors="replace") as f:
                for n, line in enumerate(f, 1):
                    if line.startswith("```"):
                        in_code = not in_code
                    elif not in_code and HEADING.search(line):
                        errors.append(f"{p}:{n}: heading names a development step: {line.strip()}")
                    elif not in_code and MENTION.search(line):
                        errors.append(f"{p}:{n}: text names a development step "
                                      f"('{MENTION.search(line).group(0)}'): {line.strip()}")
        if p.startswith("scripts/") and (p.endswith(".py") or p.endswith(".sh")):
            with open(os.path.join(ROOT, p), errors="replace") as f:
                for n, line in enumerate(f, 1):
                    m = MENTION.search(line)
                    if m:
                        errors.append(f"{p}:{n}: names a development step ('{m.group(0)}'): {line.strip()}")
        if p.startswith("bench/results/") and (p.endswith(".json") or p.endswith(".jsonl")):
            bad = []
            try:
                with open(os.path.join(ROOT, p)) as f:
                    if p.endswith(".jsonl"):
                        for line in f:
                            if line.strip():
                                json_fields(json.loads(line), "", bad)
                    else:
                        json_fields(json.load(f), "", bad)
            except ValueError as e:
                errors.append(f"{p}: not valid JSON ({e})")
            for b in sorted(set(bad)):
                errors.append(f"{p}: field named after a development step: {b}")
            with open(os.path.join(ROOT, p), errors="replace") as f:
                m = MENTION.search(f.read())
            if m:
                errors.append(f"{p}: a value names a development step ('{m.group(0)}')")
    for e in errors:
        print("check_tree:", e)
    rc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "docs_tables.py"), "--check"]).returncode
    if rc:
        errors.append("docs tables")
        print("check_tree: README.md / docs tables disagree with bench/results (scripts/docs_tables.py --check)")
    if errors:
        return 1
    print(f"check_tree: {len(files)} tracked files, no development-step names or mentions "
          f"(names, markdown, scripts/); docs tables match bench/results")
    return 0


if __name__ == "__main__":
    sys.exit(main())
