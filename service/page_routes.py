"""The web page and the sample clips it offers.

`/` serves `static/index.html` and `/static/*` its script and style; they need no API key (the
page asks for the key and sends it with every API call). `GET /v1/samples` lists the repo's
`samples/*.mp4` and `GET /v1/samples/{name}` serves one, only when that folder sits next to the
package (a source checkout); an installed wheel has none, and the page hides its picker.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from stillcut.service.errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"
SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"


def add_page_routes(app: FastAPI, samples_dir: Path = SAMPLES_DIR) -> None:
    """Add the page (`/`, `/static`) and the sample routes to `app`."""

    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    async def list_samples() -> Response:
        return JSONResponse({"samples": sorted(_samples(samples_dir))})

    async def get_sample(request: Request) -> Response:
        name = request.path_params["name"]
        found = _samples(samples_dir)
        if name not in found:
            raise APIError(
                404, f"no sample named {name!r}", type="not_found_error", code="not_found"
            )
        return FileResponse(found[name], media_type="video/mp4")

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route("/v1/samples", list_samples, methods=["GET"])
    app.add_api_route("/v1/samples/{name}", get_sample, methods=["GET"])
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def _samples(samples_dir: Path) -> dict[str, Path]:
    if not samples_dir.is_dir():
        return {}
    return {path.name: path for path in samples_dir.glob("*.mp4") if path.is_file()}
