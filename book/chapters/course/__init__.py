"""The reader's own engine: the course code the chapters mark `#@save`, one module per chapter.

`book/chapters/NN_name.md` saves into `course/name.py` (scripts/save_course.py writes them; do not
edit those files by hand). The chapters run with `book/chapters/` as their working directory, so
`import course` finds this package from a notebook, from nbval and from jupyter-book alike;
chapter 11 ("Build it yourself") imports nothing else but the GGUF reader and the dequantizer.
"""
