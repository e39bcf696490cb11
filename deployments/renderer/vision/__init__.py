"""Image input for the Renderer (docs/vision.md): image parts read, checked, decoded, cut into patches and
placed in the prompt ids.

- `parts.py`: image parts found in the messages, and the refusal that names the client's field.
- `sources.py`: a part's bytes: a `data:` URL decoded, or an `https://` URL fetched (`fetch.py`).
- `fetch.py`: fetching a public `https://` URL safely: addresses checked and pinned, redirects, caps.
- `decode.py`: bytes to RGB pixels with Pillow (pixel cap before decoding), and the pixels' SHA-256.
- `preprocess.py`: the checkpoint's preprocessor config; resize, normalise and patchify as transformers does.
- `reader.py`: `ImageReader`: a request's image parts to template items, then its placeholders expanded.
"""
