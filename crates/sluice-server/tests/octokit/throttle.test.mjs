// octokit with plugin-throttling against examples/github_api (started by scripts/test
// with --core-limit 3 --window 4s): the client is told to wait until the stored reset
// (plus the second the plugin adds), waits, and then every request succeeds.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Octokit } from "@octokit/core";
import { throttling } from "@octokit/plugin-throttling";

const baseUrl = process.env.GITHUB_API;
assert.ok(baseUrl, "set GITHUB_API to the github_api example's URL");

function client(token, waits) {
  const Throttled = Octokit.plugin(throttling);
  return new Throttled({
    baseUrl,
    auth: token,
    throttle: {
      onRateLimit: (retryAfter, _options, _octokit, retryCount) => {
        waits.push({ retryAfter, at: Date.now() });
        return retryCount < 2;
      },
      onSecondaryRateLimit: () => false,
    },
  });
}

test("rate_limit never charges, and a 304 costs nothing", async () => {
  const octokit = client("token-for-reads", []);
  const remaining = async () => (await octokit.request("GET /rate_limit")).data.resources.core.remaining;
  assert.equal(await remaining(), 3);
  assert.equal(await remaining(), 3, "GET /rate_limit must not change remaining");
  await octokit.request("GET /repos/{owner}/{repo}", { owner: "octo", repo: "hello" });
  assert.equal(await remaining(), 2);
  await assert.rejects(
    octokit.request("GET /repos/{owner}/{repo}", { owner: "octo", repo: "hello", headers: { "if-none-match": '"v1"' } }),
    (e) => e.status === 304,
  );
  assert.equal(await remaining(), 2, "a 304 Not Modified must cost nothing");
});

test("the client waits until the stored reset, then all its requests succeed", async () => {
  const waits = [];
  const octokit = client("token-for-waits", waits);
  const first = await octokit.request("GET /repos/{owner}/{repo}", { owner: "octo", repo: "hello" });
  const reset = Number(first.headers["x-ratelimit-reset"]) * 1000;
  for (let i = 0; i < 4; i++) {
    const r = await octokit.request("GET /repos/{owner}/{repo}", { owner: "octo", repo: "hello" });
    assert.equal(r.status, 200);
    assert.equal(Number(r.headers["x-ratelimit-limit"]), 3);
  }
  assert.equal(waits.length, 1, "exactly one rate-limit callback");
  // the wait the plugin computed matches the time left until the stored reset (+1 s)
  const expected = Math.ceil((reset - waits[0].at) / 1000) + 1;
  assert.ok(Math.abs(waits[0].retryAfter - expected) <= 1, `waited ${waits[0].retryAfter}s, expected about ${expected}s`);
  assert.ok(waits[0].retryAfter >= 2 && waits[0].retryAfter <= 6, `retryAfter ${waits[0].retryAfter}`);
  assert.ok(Date.now() >= reset, "the retried request went out after the reset");
});
