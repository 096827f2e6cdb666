"""The race (the lesson's Chapter 8): a simulated and a live side-by-side race between vanilla and
speculative decoding, served as one local web page by `specdec race`.

- `sim`: the seeded simulator, timed by the lesson's roofline and predicted by `specdec.theory`;
- `live`: plain decoding and a speculative method run one after the other on a real model,
  every token's wall-clock time recorded for a side-by-side replay;
- `server`: the FastAPI app (`create_app`) with the JSON endpoints and the page in `static/`.
"""
