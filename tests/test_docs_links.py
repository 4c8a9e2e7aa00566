"""Every relative link in the user documentation points at a file that exists and, for a
``#fragment`` into a Markdown file, at one of its headings (GitHub's anchors)."""
import glob
import os
import re

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
