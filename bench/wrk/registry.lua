-- bench/wrk/registry.lua — the request mix of `ferry bench registry --layer-mode get`,
-- for wrk, so the registry LPM figure does not rest on ferry's own tester.
--
-- One node start = manifest GET by tag (with the usual Accept list), config blob GET,
-- then one ranged GET (Range: bytes=0-RANGE-1) per layer. wrk cannot run the token
-- flow, so the caller passes the finished Authorization header value (a bearer token it
-- fetched, or Basic credentials: whatever the registry's challenge asks for).
--
-- Environment (all required except WRK_RANGE):
--   WRK_REPO    repository, e.g. bench/app
--   WRK_TAG     tag, e.g. v1
--   WRK_CONFIG  config blob digest
--   WRK_LAYERS  layer digests, space-separated
--   WRK_AUTH    Authorization header value ("Bearer …" or "Basic …"); empty = none
--   WRK_RANGE   bytes per layer GET (default 4096; 0 = whole blob)
--
-- At the end it prints one JSON line starting with "WRKJSON " (requests, seconds,
-- errors (wrk's "status" = non-2xx/3xx responses), latency percentiles in microseconds,
-- layers per start), which
-- bench/registry.sh turns into LPM = requests/s * 60 * layers / (layers + 2).

local function env(name, default)
    local v = os.getenv(name)
    if v == nil or v == "" then
        if default == nil then
            error("bench/wrk/registry.lua: " .. name .. " is not set")
        end
        return default
    end
    return v
end

local accept = "application/vnd.oci.image.manifest.v1+json, " ..
    "application/vnd.oci.image.index.v1+json, " ..
    "application/vnd.docker.distribution.manifest.v2+json, " ..
    "application/vnd.docker.distribution.manifest.list.v2+json"

local threads_made = 0

-- Runs in the main state once per thread, before init: number the threads.
function setup(thread)
    thread:set("id", threads_made)
    threads_made = threads_made + 1
end

local requests = {}
local layer_count = 0
local next_index = 0

-- Runs once per wrk thread: pre-format the cycle of requests of one node start.
function init(args)
    local repo = env("WRK_REPO")
    local tag = env("WRK_TAG")
    local config = env("WRK_CONFIG")
    local auth = os.getenv("WRK_AUTH") or ""
    local range = tonumber(env("WRK_RANGE", "4096"))
    local base = {}
    if auth ~= "" then
        base["Authorization"] = auth
    end
    local function headers(extra)
        local h = {}
        for k, v in pairs(base) do h[k] = v end
        for k, v in pairs(extra or {}) do h[k] = v end
        return h
    end
    requests[#requests + 1] = wrk.format("GET", "/v2/" .. repo .. "/manifests/" .. tag,
        headers({ ["Accept"] = accept }))
    requests[#requests + 1] = wrk.format("GET", "/v2/" .. repo .. "/blobs/" .. config, headers())
    local ranged = {}
    if range > 0 then
        ranged["Range"] = "bytes=0-" .. tostring(range - 1)
    end
    for digest in string.gmatch(env("WRK_LAYERS"), "%S+") do
        requests[#requests + 1] = wrk.format("GET", "/v2/" .. repo .. "/blobs/" .. digest, headers(ranged))
        layer_count = layer_count + 1
    end
    -- Threads start at different points of the cycle so they do not move in lockstep.
    next_index = ((id or 0) * 3) % #requests
end

function request()
    next_index = next_index % #requests + 1
    return requests[next_index]
end

function done(summary, latency, requests_)
    local e = summary.errors
    local layers = 0
    for digest in string.gmatch(os.getenv("WRK_LAYERS") or "", "%S+") do
        layers = layers + 1
    end
    io.write(string.format(
        'WRKJSON {"requests": %d, "seconds": %.3f, "layers_per_start": %d, ' ..
        '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}, ' ..
        '"latency_us": {"p50": %d, "p90": %d, "p99": %d, "max": %d, "mean": %.1f}}\n',
        summary.requests, summary.duration / 1e6, layers,
        e.connect, e.read, e.write, e.status, e.timeout,
        latency:percentile(50), latency:percentile(90), latency:percentile(99),
        latency.max, latency.mean))
end
