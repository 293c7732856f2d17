// The stillcut page: describe a video (filmstrip of what EVS kept, streamed answer) or stream a
// sample's frames live over the WebSocket. Plain browser JavaScript, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORE = "stillcut.apiKey";

function apiKey() { return sessionStorage.getItem(KEY_STORE) || ""; }

function askForKey() {
  const key = window.prompt("API key for this server (kept for this tab only):", apiKey());
  if (key !== null) sessionStorage.setItem(KEY_STORE, key.trim());
  return key !== null;
}

function authHeaders() {
  const key = apiKey();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

// A browser cannot set headers on a WebSocket; the key travels as a subprotocol beside
// "stillcut" (the one the server selects), base64url-encoded so any key is a valid token.
function socketProtocols() {
  const key = apiKey();
  if (!key) return ["stillcut"];
  const bytes = new TextEncoder().encode(key);
  const encoded = btoa(String.fromCharCode(...bytes))
    .replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  return ["stillcut", `stillcut.bearer.${encoded}`];
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error ? body.error.message : `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status} ${response.statusText}`;
  }
}

// A fetch that asks for the key once when the server wants one, then retries.
async function apiFetch(path, options = {}) {
  let response = await fetch(path, { ...options, headers: { ...authHeaders() } });
  if (response.status === 401 && askForKey()) {
    response = await fetch(path, { ...options, headers: { ...authHeaders() } });
  }
  if (!response.ok) throw new Error(await errorMessage(response));
  return response;
}

async function loadSamples() {
  let names = [];
  try {
    names = (await (await apiFetch("/v1/samples")).json()).samples;
  } catch {
    names = [];
  }
  for (const el of document.querySelectorAll(".samples-only")) el.hidden = names.length === 0;
  for (const select of [$("sample"), $("live-sample")]) {
    select.replaceChildren(new Option("(none)", ""));
    for (const name of names) select.add(new Option(name, name));
  }
  if (navigator.mediaDevices?.getUserMedia) $("live-sample").add(new Option("webcam", WEBCAM));
  $("live-picker").hidden = $("live-sample").options.length < 2;
  if (names.length) $("live-sample").value = names[0];
}

async function sampleBlob(name) {
  return (await apiFetch(`/v1/samples/${encodeURIComponent(name)}`)).blob();
}

// What the demo model answers about each task sample, beside the truth (a static file that
// samples/make_samples.py writes); shown when that sample is picked.
let sampleAnswers = null;

async function loadSampleAnswers() {
  try {
    const response = await fetch("/static/sample_answers.json");
    sampleAnswers = response.ok ? await response.json() : null;
  } catch {
    sampleAnswers = null;
  }
  showSampleAnswers();
}

function showSampleAnswers() {
  const rows = sampleAnswers?.samples?.[$("sample").value];
  $("sample-answers").hidden = !rows;
  if (!rows) return;
  $("sample-answers-note").textContent =
    `What ${sampleAnswers.model} answered about this clip (EVS ${sampleAnswers.evs}), beside the truth.`;
  const cell = (tag, text, className = "") => {
    const element = document.createElement(tag);
    element.textContent = text;
    if (className) element.className = className;
    return element;
  };
  const header = document.createElement("tr");
  header.append(cell("th", "question"), cell("th", "demo answer"), cell("th", "true answer"));
  const body = rows.map((row) => {
    const line = document.createElement("tr");
    line.className = "sample-answer";
    line.append(
      cell("td", row.question),
      cell("td", `${row.correct ? "✓" : "✗"} ${row.answer}`, row.correct ? "" : "wrong"),
      cell("td", row.truth),
    );
    return line;
  });
  $("sample-answers-table").replaceChildren(header, ...body);
}

function evsField() {
  const mode = $("evs-mode").value;
  if (mode === "off") return "off";
  return JSON.stringify({ mode, [mode]: Number($("evs-value").value) });
}

// Server-sent events from a fetch body: calls onEvent with each parsed `data:` payload.
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const chunk = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6));
      if (data.length && data[0] !== "[DONE]") onEvent(JSON.parse(data.join("\n")));
    }
  }
}

async function describe(event) {
  event.preventDefault();
  showError("");
  $("answer").textContent = "";
  $("result").hidden = true;
  const file = $("file").files[0];
  const sample = $("sample").value;
  if (!file && !sample) return showError("Choose a video file or a sample first.");
  $("ask").disabled = true;
  document.body.dataset.state = "busy";
  try {
    const form = new FormData();
    form.append("file", file || new File([await sampleBlob(sample)], sample, { type: "video/mp4" }));
    form.append("prompt", $("prompt").value);
    form.append("evs", evsField());
    form.append("max_tokens", $("max-tokens").value);
    form.append("stream", "true");
    form.append("include_frames", "true");
    const response = await apiFetch("/v1/videos/describe", { method: "POST", body: form });
    await readEvents(response, (data) => {
      if (data.type === "token") $("answer").textContent += data.text;
      else if (data.type === "result") showResult(data);
      else if (data.error) showError(data.error.message);
    });
  } catch (error) {
    showError(error.message);
  } finally {
    $("ask").disabled = false;
    document.body.dataset.state = "done";
  }
}

function showResult(result) {
  $("answer").textContent = result.text;
  renderFilmstrip(result.frames);
  renderBars($("bars"), result.evs.kept_per_tubelet, result.frames.grid[1] * result.frames.grid[2]);
  const t = result.timings;
  const rows = [
    ["EVS", result.evs.setting],
    ["frames", result.evs.frames],
    ["tokens before EVS", result.evs.tokens_before],
    ["tokens after EVS", result.evs.tokens_after],
    ["decode", `${t.decode_s.toFixed(3)} s`],
    ["encode", `${t.encode_s.toFixed(3)} s`],
    ["time to first token", `${t.ttft_s.toFixed(3)} s`],
    ["total", `${t.total_s.toFixed(3)} s`],
  ];
  $("numbers").replaceChildren(...rows.flatMap(([name, value]) => {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = name;
    dd.textContent = value;
    return [dt, dd];
  }));
  $("result").hidden = false;
}

// Each frame with its tubelet's retention mask on top: pruned cells dimmed, kept ones outlined.
function renderFilmstrip(frames) {
  const [, h, w] = frames.grid;
  const strip = frames.thumbnails.map((thumb, k) => {
    const tubelet = Math.floor(k / frames.frames_per_tubelet);
    const figure = document.createElement("figure");
    figure.className = "frame";
    figure.dataset.tubelet = tubelet;
    const img = document.createElement("img");
    img.src = `data:image/jpeg;base64,${thumb}`;
    img.alt = `frame ${k}`;
    const grid = document.createElement("div");
    grid.className = "grid";
    grid.style.gridTemplate = `repeat(${h}, 1fr) / repeat(${w}, 1fr)`;
    img.addEventListener("load", () => { grid.style.height = `${img.clientHeight}px`; });
    for (const row of frames.retention[tubelet]) {
      for (const kept of row) {
        const cell = document.createElement("div");
        cell.className = kept ? "cell kept" : "cell pruned";
        grid.append(cell);
      }
    }
    const caption = document.createElement("figcaption");
    caption.textContent = `frame ${k} · tubelet ${tubelet}`;
    figure.append(img, grid, caption);
    return figure;
  });
  $("filmstrip").replaceChildren(...strip);
}

function renderBars(container, kept, total) {
  container.replaceChildren(...kept.map((n, i) => barOf(n, total, i)));
}

function barOf(kept, total, index) {
  const bar = document.createElement("div");
  bar.className = "bar";
  bar.title = `tubelet ${index}: ${kept}/${total} kept`;
  const fill = document.createElement("span");
  fill.style.height = `${(100 * kept) / Math.max(total, 1)}%`;
  bar.append(fill);
  return bar;
}

// Live mode: play the chosen sample in a hidden <video>, grab frames at `fps` through a canvas
// and send each as 8 bytes of little-endian float64 seconds followed by the JPEG bytes. With
// "Narrate" the session narrates (the prompt is its instruction) instead of answering asks.
const live = { socket: null, running: false, narrating: false };
const WEBCAM = "__webcam__";
const LIVE_FPS = 2;

async function startLive(event) {
  event.preventDefault();
  showError("");
  const source = $("live-sample").value;
  if (!source) return showError("Choose a sample or the webcam to stream.");
  const video = $("live-video");
  try {
    if (source === WEBCAM) {
      video.srcObject = await navigator.mediaDevices.getUserMedia({ video: true });
      await video.play();
    } else {
      video.srcObject = null;
      video.src = URL.createObjectURL(await sampleBlob(source));
      await new Promise((resolve, reject) => {
        video.onloadeddata = resolve;
        video.onerror = () => reject(new Error("this browser cannot decode the sample"));
      });
    }
  } catch (error) {
    return showError(error.message);
  }
  $("live-bars").replaceChildren();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/v1/stream`, socketProtocols());
  socket.binaryType = "arraybuffer";
  live.socket = socket;
  live.narrating = $("live-narrate").checked;
  $("live-answer").textContent = "";
  socket.onopen = () => {
    const threshold = Number($("live-threshold").value);
    // a camera cannot wait for the model: it skips to the newest tubelet; a file is seeked
    const narrate = { mode: "narrate", prompt: $("live-prompt").value,
                      lag: source === WEBCAM ? "latest" : "queue" };
    const options = live.narrating ? narrate : { max_tokens: 64 };
    socket.send(JSON.stringify({ type: "start", threshold, fps: LIVE_FPS, ...options }));
  };
  socket.onmessage = (message) => onLiveMessage(JSON.parse(message.data), video);
  socket.onclose = (close) => {
    live.running = false;
    $("live-status").textContent = close.reason ? `Closed: ${close.reason}` : "Stopped.";
    setLiveButtons(false);
  };
}

function onLiveMessage(data, video) {
  if (data.type === "started") {
    live.running = true;
    setLiveButtons(true);
    $("live-status").textContent = "Streaming…";
    sendFrames(video);
  } else if (data.type === "frame") {
    $("live-bars").append(barOf(data.kept, data.total, data.tubelet));
    $("live-status").textContent = `Tubelet ${data.tubelet}: kept ${data.kept}/${data.total}`;
  } else if (data.type === "token") {
    $("live-answer").textContent += data.text;
  } else if (data.type === "answer") {
    $("live-answer").textContent = data.text;
  } else if (data.type === "segment") {
    const [first, last] = data.t;
    const skipped = data.skipped ? `, ${data.skipped} skipped` : "";
    $("live-answer").textContent += `  [${first.toFixed(1)}-${last.toFixed(1)} s${skipped}]\n`;
  } else if (data.type === "rollover") {
    $("live-answer").textContent += "[rollover]\n";
  } else if (data.type === "error") {
    showError(data.message);
    if (data.code === "invalid_api_key") askForKey();  // the next Start sends the new key
  }
}

async function sendFrames(video) {
  const canvas = $("live-canvas");
  canvas.width = video.videoWidth;
  canvas.height = video.videoHeight;
  const context = canvas.getContext("2d");
  const webcam = video.srcObject !== null;
  for (let k = 0; live.running && (webcam || k / LIVE_FPS < video.duration); k += 1) {
    const t = k / LIVE_FPS;
    if (webcam) {  // a camera runs in real time: take a frame every 1 / fps seconds
      await new Promise((resolve) => setTimeout(resolve, k ? 1000 / LIVE_FPS : 0));
    } else {  // a file is seeked frame by frame, as fast as the server takes them
      video.currentTime = t;
      await new Promise((resolve) => { video.onseeked = resolve; });
    }
    context.drawImage(video, 0, 0);
    const jpeg = await new Promise((resolve) => canvas.toBlob(resolve, "image/jpeg", 0.85));
    const stamp = new DataView(new ArrayBuffer(8));
    stamp.setFloat64(0, t, true);
    const frame = await new Blob([stamp.buffer, jpeg]).arrayBuffer();
    // checked after the last await: the socket may have closed while the frame was packed
    if (live.socket.readyState !== WebSocket.OPEN) break;
    live.socket.send(frame);
  }
  if (webcam) {
    for (const track of video.srcObject.getTracks()) track.stop();
  } else {
    $("live-status").textContent += live.narrating ? " (all frames sent)" : " (all frames sent; ask away)";
  }
}

function setLiveButtons(running) {
  $("live-start").disabled = running;
  $("live-stop").disabled = !running;
  $("live-ask").disabled = !running || live.narrating;
}

function stopLive() {
  live.running = false;
  if (live.socket && live.socket.readyState === WebSocket.OPEN) {
    live.socket.send(JSON.stringify({ type: "stop" }));
  }
}

function askLive(event) {
  event.preventDefault();
  $("live-answer").textContent = "";
  live.socket.send(JSON.stringify({ type: "ask", prompt: $("live-prompt").value }));
}

function showTab(name) {
  $("describe-panel").hidden = name !== "describe";
  $("live-panel").hidden = name !== "live";
  $("tab-describe").classList.toggle("active", name === "describe");
  $("tab-live").classList.toggle("active", name === "live");
}

$("describe-form").addEventListener("submit", describe);
$("live-form").addEventListener("submit", startLive);
$("live-stop").addEventListener("click", stopLive);
$("live-ask-form").addEventListener("submit", askLive);
$("sample").addEventListener("change", showSampleAnswers);
$("tab-describe").addEventListener("click", () => showTab("describe"));
$("tab-live").addEventListener("click", () => showTab("live"));
$("set-key").addEventListener("click", askForKey);
$("evs-mode").addEventListener("change", () => {
  $("evs-value").value = $("evs-mode").value === "threshold" ? "0.1" : "0.75";
  $("evs-value").disabled = $("evs-mode").value === "off";
});
loadSamples();
loadSampleAnswers();
