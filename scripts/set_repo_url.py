"""Write the repository URL of _config.yml (its one home) into every Colab badge, install cell
and clone command of the book. Usage: python scripts/set_repo_url.py  (tests/test_book_chapters.py
fails while any page disagrees with _config.yml)."""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = r"https://github\.com/[\w.-]+/[\w.-]+?"
PLACES = [  # (pattern, replacement template): the places that name this book's repository
    (re.compile(r"colab\.research\.google\.com/github/[\w.-]+/[\w.-]+/"), "colab.research.google.com/github/{path}/"),
    (re.compile(rf"git\+{REPO}(?=[\"'\s@]|$)"), "git+{url}"),
    (re.compile(rf"git clone {REPO}(?=\s|$)", re.MULTILINE), "git clone {url}"),
    (re.compile(rf"{REPO}/blob/main/"), "{url}/blob/main/"),
]


def url() -> str:
    return re.search(r"^repository:\s*\n\s+url:\s*(\S+)", (ROOT / "_config.yml").read_text(), re.MULTILINE).group(1)


def rewrite(text: str, repo: str) -> str:
    for pattern, template in PLACES:
        text = pattern.sub(template.format(url=repo, path=repo.removeprefix("https://github.com/")), text)
    return text


def main() -> None:
    repo = url()
    for nb_path in sorted([*(ROOT / "chapters").glob("*.ipynb"), *(ROOT / "solutions").glob("*.ipynb")]):
        nb = json.loads(nb_path.read_text())
        for cell in nb["cells"]:
            cell["source"] = rewrite("".join(cell["source"]), repo).splitlines(keepends=True)
        nb_path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    for md in (ROOT / "book").glob("*.md"):
        md.write_text(rewrite(md.read_text(), repo))
    print(f"repository URL set to {repo}")


if __name__ == "__main__":
    main()
