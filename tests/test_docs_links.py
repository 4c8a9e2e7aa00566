"""Every relative link in the user documentation points at a file that exists and, for a
``#fragment`` into a Markdown file, at one of its headings (GitHub's anchors); every path,
module path and command the documentation names in code exists, and every flag it shows
a command with is one that command takes."""
import glob
import json
import os
import re
import subprocess
import sys
from hang import HANG_SECONDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md', 'benchmarks/README.md'] + [
    os.path.relpath(p, ROOT) for pattern in ('docs/**/*.md', 'experiments/**/README.md')
    for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)]
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')


def anchors(path):
    """GitHub's heading anchors of a Markdown file: lower case, punctuation but - and _
    dropped, spaces to hyphens; a repeated heading gets -1, -2, ..."""
    found, seen = set(), {}
    with open(path) as f:
        text = re.sub(r'^```.*?^```', '', f.read(), flags=re.M | re.S)  # no headings in code
    for title in re.findall(r'^#{1,6} +(.+?) *$', text, re.M):
        slug = re.sub(r'[^\w\- ]', '', title.lower()).replace(' ', '-')
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else '%s-%d' % (slug, n))
    return found


def test_anchors_follow_githubs_rules(tmp_path):
    page = tmp_path / 'p.md'
    page.write_text('# A page\n## Batch size and learning rate\n## When (`--kvstore device` / `nccl`)\n'
                    '## Notes\n## Notes\n```\n# not a heading\n```\n')
    assert anchors(str(page)) == {'a-page', 'batch-size-and-learning-rate', 'when---kvstore-device--nccl',
                                  'notes', 'notes-1'}


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = re.sub(r'^```.*?^```', '', f.read(), flags=re.M | re.S)
        for target in LINK.findall(text):
            if re.match(r'[a-z]+:', target):
                continue  # http(s), mailto: not checked here
            path, _, fragment = target.partition('#')
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else \
                os.path.join(ROOT, page)
            if not os.path.exists(full):
                broken.append('%s: %s (no such file)' % (page, target))
            elif fragment and full.endswith('.md') and fragment not in anchors(full):
                broken.append('%s: %s (no such heading)' % (page, target))
    assert not broken, '\n'.join(broken)


# -- what the docs name in code: files, module paths, commands and their flags ------------------

#: The pages whose code is checked: what a user reads (experiments/ keeps history as it was).
USER_PAGES = [p for p in PAGES if not p.startswith('experiments/')]
FENCE = re.compile(r'^```[^\n]*\n(.*?)^```', re.M | re.S)
SPAN = re.compile(r'`([^`\n]+)`')
#: A path of this repository, or one inside the package written from gluon_unet/.
REPO_PATH = re.compile(r'^(?:gluon_unet|tests|benchmarks|docs|experiments|bin|\.ci)(?:/[\w.-]*)*$')
PACKAGE_PATH = re.compile(r'^(?:training|inference|machine|data|cli|recipes)/[\w.-]+$')
DOTTED = re.compile(r'^gluon_unet(?:\.\w+)+')
COMMAND = re.compile(r'(?:^|[\s(])(?:\S*python3?(?:\.\d+)? )?(?:(bin)/(\w+)|(gluon-unet) (\w+)|-m (gluon_unet) (\w+)'
                     r'|(benchmarks)/(\w+\.py))(.*)')
FLAG = re.compile(r'(?<![\w-])(--[a-z][\w-]*)')


def _code(page):
    """``[(line number, text)]``: each fenced line (continuations joined) and inline span."""
    with open(os.path.join(ROOT, page)) as f:
        text = f.read()
    found = []
    for block in FENCE.finditer(text):
        start = text[:block.start()].count('\n') + 2
        lines = block.group(1).replace('\\\n', ' ').split('\n')
        found += [(start + i, line) for i, line in enumerate(lines)]
    prose = FENCE.sub(lambda m: '\n' * m.group(0).count('\n'), text)
    for i, line in enumerate(prose.split('\n')):
        found += [(i + 1, span) for span in SPAN.findall(line)]
    return found


def _placeholder(text):
    return bool(re.search(r'(?<![a-z])[A-Z]{2,}(?![a-z])', text)) or '...' in text or '<' in text or '*' in text


def test_paths_the_docs_name_exist():
    missing = []
    for page in USER_PAGES:
        for line, text in _code(page):
            token = text.strip().rstrip('/').split(':')[0]
            if _placeholder(token) or ' ' in token:
                continue
            if REPO_PATH.match(token) and not os.path.exists(os.path.join(ROOT, token)):
                missing.append('%s:%d %s' % (page, line, token))
            elif PACKAGE_PATH.match(token) and not os.path.exists(os.path.join(ROOT, 'gluon_unet', token)):
                missing.append('%s:%d %s' % (page, line, token))
    assert not missing, 'paths named in the docs that do not exist:\n' + '\n'.join(missing)


RESOLVE = r'''
import importlib, json, sys, warnings
# A path of gluon_unet 0.2 (gluon_unet/_moved) does not count as existing.
warnings.filterwarnings('error', message=r'gluon_unet\.\S+ moved to', category=DeprecationWarning)
bad = []
for name in json.loads(sys.argv[1]):
    parts, obj = name.split('.'), None
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:i]))
        except ImportError:
            continue
        except DeprecationWarning:
            break
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except (AttributeError, DeprecationWarning):
            obj = None
        break
    if obj is None:
        bad.append(name)
print(json.dumps(bad))
'''


def test_module_paths_the_docs_name_exist():
    # Lines about the old layout name its paths on purpose ("gluon_unet 0.2's module paths").
    names = {}
    for page in USER_PAGES:
        with open(os.path.join(ROOT, page)) as f:
            old = {i + 1 for i, line in enumerate(f) if 'gluon_unet 0.2' in line}
        for line, text in _code(page):
            match = DOTTED.match(text.strip())
            if match and line not in old:
                names.setdefault(match.group(0), '%s:%d' % (page, line))
    assert 'gluon_unet.inference.load_exported' in names  # the check sees what the docs say
    done = subprocess.run([sys.executable, '-c', RESOLVE, json.dumps(sorted(names))], cwd=ROOT,
                          capture_output=True, text=True, timeout=HANG_SECONDS, env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 0, done.stderr[-2000:]
    bad = json.loads(done.stdout.strip().splitlines()[-1])
    assert not bad, 'module paths in the docs that do not resolve:\n' + '\n'.join(
        '%s %s' % (names[n], n) for n in bad)


def _benchmark_flags(script):
    with open(os.path.join(ROOT, 'benchmarks', script)) as f:
        source = f.read()
    flags = set(re.findall(r"add_argument\(\s*(?:'-\w',\s*)?'(--[\w-]+)'", source))
    negated = re.findall(r"add_argument\(\s*'--([\w-]+)'[^)]*BooleanOptionalAction", source)
    return flags | {'--no-' + f for f in negated} | {'--help'}


def _command_flags(command):
    from gluon_unet.cli.reference import parser_of
    parser = parser_of(command)
    return {s for action in parser._actions for s in action.option_strings}


def test_commands_the_docs_show_exist_with_their_flags():
    from gluon_unet.cli import COMMANDS
    bad, seen = [], 0
    for page in USER_PAGES:
        for line, text in _code(page):
            for match in COMMAND.finditer(text):
                groups = match.groups()
                kind, name, rest = next((groups[i], groups[i + 1]) for i in range(0, 8, 2) if groups[i]) + \
                    (groups[8],)
                rest = re.split(r'\s(?:\||&&|;|#)|\s--\s', ' ' + rest)[0]  # this command's own flags
                where = '%s:%d %s' % (page, line, text.strip()[:80])
                if kind == 'benchmarks':
                    if not os.path.exists(os.path.join(ROOT, 'benchmarks', name)):
                        bad.append('%s: no benchmarks/%s' % (where, name))
                        continue
                    known = _benchmark_flags(name)
                elif name not in COMMANDS:
                    if kind == 'bin' and not _placeholder(name) and not os.path.exists(os.path.join(ROOT, 'bin', name)):
                        bad.append('%s: no command %s' % (where, name))
                    continue
                else:
                    known = _command_flags(name)
                seen += 1
                bad += ['%s: %s' % (where, flag) for flag in FLAG.findall(rest)
                        if flag not in known and not _placeholder(flag)]
    assert seen > 50  # the check sees the docs' commands
    assert not bad, 'commands in the docs with a flag their command does not take:\n' + '\n'.join(bad)
