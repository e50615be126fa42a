#!/usr/bin/env python3
"""Reads critest's JUnit reports (--ginkgo.junit-report) for scripts/critest.sh.

  junit.py summary REPORT          one line: passed / failed / skipped specs
  junit.py failures REPORT         each spec that did not pass or skip, with the
                                   first line of its failure message
  junit.py compare DIRECT PROXY    exits 1, naming them, when a spec that passed
                                   against containerd did not pass through the proxy
  junit.py focus DIRECT PROXY [RETRY]
                                   one ginkgo --focus regular expression matching
                                   just those specs, less those that passed in the
                                   RETRY report (nothing when none are left)

A spec is a test case named "[It] ..."; the suite nodes ([BeforeSuite] and the like)
are not counted, but a failed one is reported, since it fails every spec after it.
"""

import re
import sys
import xml.etree.ElementTree as ET

# Gomega's line naming a value's Go type, as in "<*status.Error | 0x36fb1240b520>:".
GO_VALUE_TYPE = re.compile(r"^<[^>]* \| 0x[0-9a-f]+>:?$")


def read(path):
    """{name: (status, message)} for every test case in the report, in report order."""
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        status = case.get("status")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if status is None:  # not written by ginkgo: derive it from the children
            if failure is not None:
                status = "failed"
            elif case.find("skipped") is not None:
                status = "skipped"
            else:
                status = "passed"
        message = ""
        if failure is not None:
            text = (failure.get("message") or failure.text or "").strip()
            # The first lines say what failed ("Expected <string>: ... to be empty",
            # "Unexpected error: <*status.Error>: rpc error: ..."); the rest is detail.
            lines = [line.strip() for line in text.splitlines()
                     if line.strip() not in ("", "{") and not GO_VALUE_TYPE.match(line.strip())]
            message = " ".join(lines[:3])
            if len(message) > 300:
                message = message[:297] + "..."
        cases[name] = (status, message)
    return cases


def specs(cases):
    return {name: value for name, value in cases.items() if name.startswith("[It]")}


def counts(cases):
    statuses = [status for status, _ in specs(cases).values()]
    passed = statuses.count("passed")
    skipped = statuses.count("skipped") + statuses.count("pending")
    return passed, len(statuses) - passed - skipped, skipped, len(statuses)


def summary_line(cases):
    passed, failed, skipped, total = counts(cases)
    line = f"{passed} passed, {failed} failed, {skipped} skipped (of {total} specs)"
    broken = [name for name, (status, _) in cases.items()
              if not name.startswith("[It]") and status not in ("passed", "skipped")]
    if broken:
        line += "; suite node failed: " + ", ".join(broken)
    return line


def failures(cases):
    return [(name, message) for name, (status, message) in specs(cases).items()
            if status not in ("passed", "skipped", "pending")]


def regressions(direct, proxy):
    return [
        (name, proxy.get(name, ("missing", "not in the proxy run's report")))
        for name, (status, _) in specs(direct).items()
        if status == "passed" and proxy.get(name, ("missing",))[0] != "passed"
    ]


# The decorations ginkgo appends to a case's name ("[Serial]", "[Conformance]"):
# the focus matches the spec's text, so they are left out of the expression.
TRAILING_LABELS = re.compile(r"(\s+\[[^\]]*\])+$")


def focus(names):
    texts = [TRAILING_LABELS.sub("", name.removeprefix("[It] ")) for name in names]
    # Go's regexp (RE2) rejects Python's escaped spaces: escape its operators only.
    return "|".join(re.sub(r"([\\.+*?()|\[\]{}^$])", r"\\\1", text) for text in texts)


def main(argv):
    if len(argv) == 3 and argv[1] == "summary":
        print(summary_line(read(argv[2])))
        return 0
    if len(argv) == 3 and argv[1] == "failures":
        for name, message in failures(read(argv[2])):
            print(f"  {name}\n      {message}")
        return 0
    if len(argv) == 4 and argv[1] == "compare":
        found = regressions(read(argv[2]), read(argv[3]))
        if not found:
            print("every spec that passed against containerd also passed through the proxy")
            return 0
        print(f"{len(found)} spec(s) passed against containerd but not through the proxy:")
        for name, (status, message) in found:
            print(f"  {name}  [{status}]\n      {message}")
        return 1
    if len(argv) in (4, 5) and argv[1] == "focus":
        names = [name for name, _ in regressions(read(argv[2]), read(argv[3]))]
        if len(argv) == 5:
            retry = read(argv[4])
            names = [name for name in names if retry.get(name, ("missing",))[0] != "passed"]
        if names:
            print(focus(names))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
