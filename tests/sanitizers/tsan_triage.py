#!/usr/bin/env python3
"""Sorts ThreadSanitizer reports into kvpool's races and third-party-only ones.

Usage: tsan_triage.py REPO_DIR BUILD_DIR REPORT_FILE...   (exit 1 when a report is kvpool's)

Debian's gRPC and protobuf are not built with TSan: their internal synchronization (completion
queues, call arenas, the event engine) is invisible to it, so TSan reports races on gRPC's own
objects in every program that uses gRPC. TSan's suppressions cannot tell those apart from
kvpool's races (a `race:` entry matches any frame of either stack, `race_top:` the top frame of
either access), so reports are sorted here instead, by who owns each racing access:

- the owner of an access is the first frame of its stack that is not the TSan runtime, the C++
  standard library (headers or libstdc++), Abseil or protobuf inline header code, or
  protoc-generated code in BUILD_DIR (all of which act on behalf of their caller);
- a report is kvpool's when both accesses are owned by kvpool's own source (server/, client/,
  kernels/, tests/, calibration/ under REPO_DIR): it fails the run. kvpool's server reactors
  tell TSan the order gRPC gives their callbacks (server/grpc_reactor_order.h), so what remains
  here is a real race;
- when one access is kvpool's and the other gRPC's, the memory was handed over between them (a
  message kvpool filled and gRPC sends, a buffer gRPC filled and kvpool reads); the hand-off is
  inside libgrpc, where TSan cannot see it, so these are listed as hand-offs, not failed;
- when one access is kvpool's and TSan no longer has the other's stack, the report is listed as
  unknown (the run keeps a larger history, history_size=4, to make these rare);
- otherwise both accesses belong to gRPC, protobuf or Abseil internals (their libraries or
  gRPC's inline headers): counted and listed by owner, not failed.

Any report that is not a data race (deadlock, use of a destroyed mutex, signal-unsafe call,
thread leak, ...) fails. Known limitations, all from gRPC not being instrumented: kvpool touching
a message after handing it to gRPC looks like a hand-off, and a misuse of the callback API (two
StartWrite at once) races on gRPC's own objects and counts as third-party.
"""
import re
import sys

ACCESS = re.compile(r'^  (?:Previous )?(?:[Aa]tomic )?(?:[Rr]ead|[Ww]rite) of size')
OWN_DIRS = ('server/', 'client/', 'kernels/', 'tests/', 'calibration/')


PASS_THROUGH = ('/usr/include/c++/', '/usr/include/absl/', '/usr/include/google/protobuf/')
FRAME_RE = re.compile(r'^    #\d+ (.+?) (\S+?)(?::\d+)?(?::\d+)? \((\S+?)\+0x[0-9a-f]+\)$')


def owner(lines, i, build):
  """The owning frame of the access whose header is lines[i]: (function, path or module)."""
  for line in lines[i + 1:]:
    if not line.startswith('    #'):
      break
    m = FRAME_RE.match(line)
    if not m:
      continue
    func, path, module = m.group(1), m.group(2), m.group(3)
    if 'libsanitizer' in path or module.startswith('libtsan'):
      continue
    if path.startswith(PASS_THROUGH) or module.startswith('libstdc++'):
      continue
    if path.startswith(build + '/proto/'):
      continue
    return func, path if path != '<null>' else module
  return 'no stack (TSan history lost)', ''


def is_own(path, repo):
  if not path.startswith(repo + '/'):
    return False
  return path[len(repo) + 1:].startswith(OWN_DIRS)


def main():
  repo = sys.argv[1].rstrip('/')
  build = sys.argv[2].rstrip('/')
  own, third, handoff, lost, other = [], {}, {}, {}, []
  for name in sys.argv[3:]:
    text = open(name, errors='replace').read()
    for report in text.split('==================\n'):
      if 'WARNING: ThreadSanitizer' not in report:
        continue
      head = re.search(r'WARNING: ThreadSanitizer: (.*?) \(pid', report)
      kind = head.group(1) if head else 'unknown'
      lines = report.split('\n')
      if not kind.startswith('data race'):
        other.append((name, kind, report))
        continue
      owners = [owner(lines, i, build) for i, l in enumerate(lines) if ACCESS.match(l)]
      if owners and all(is_own(path, repo) for _, path in owners):
        own.append((name, report))
      elif any(is_own(path, repo) for _, path in owners) and any(not p for _, p in owners):
        # TSan no longer had the other access's stack (its history is bounded): unknown.
        key = 'one stack lost: ' + ' / '.join(
            sorted({re.sub(r'[<(].*', '', f)[:80] for f, p in owners if p}))
        lost[key] = lost.get(key, 0) + 1
      elif any(is_own(path, repo) for _, path in owners):
        # kvpool wrote (or read) memory it handed to gRPC, or gRPC handed to it (a slice, a
        # message); the hand-off happens inside libgrpc, where TSan cannot see it.
        key = 'hand-off: ' + ' / '.join(sorted({re.sub(r'[<(].*', '', f)[:80] for f, _ in owners}))
        handoff[key] = handoff.get(key, 0) + 1
      else:
        key = ' / '.join(sorted({re.sub(r'[<(].*', '', f)[:80] for f, _ in owners}))
        third[key] = third.get(key, 0) + 1
  print(f'tsan triage: {len(own)} kvpool race(s), {sum(third.values())} inside gRPC/protobuf/'
        f'Abseil, {sum(handoff.values())} on memory handed between kvpool and gRPC, '
        f'{sum(lost.values())} with a lost stack, {len(other)} other report(s)')
  for key, n in sorted(lost.items(), key=lambda kv: -kv[1]):
    print(f'  x{n} {key}')
  for key, n in sorted(handoff.items(), key=lambda kv: -kv[1]):
    print(f'  x{n} {key}')
  for key, n in sorted(third.items(), key=lambda kv: -kv[1]):
    print(f'  x{n} third-party: {key}')
  for name, kind, report in other:
    print(f'---- {name}: {kind}\n{report}')
  for name, report in own:
    print(f'---- {name}: kvpool race\n{report}')
  return 1 if own or other else 0


if __name__ == '__main__':
  sys.exit(main())
