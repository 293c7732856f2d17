"""Long-video summaries: captions of chunks with their times (a timeline), then a summary.

- `prompts`: the chunk-caption and aggregation prompts (the demo model is trained on them);
- `chunks`: how a video is cut and how long a chunk may be;
- `chunk_stream`: the chunks through the vision tower, the encoder cache per chunk;
- `summarize`: captions in flight through the engine, then aggregation in rounds (`rounds`),
  all run through a `host` (the Python API's or the service's);
- `result` and `when`: the timeline and summary, and questions about when things happen.
"""
