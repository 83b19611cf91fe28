"""A tiny kubelet credential provider plugin for the tests (credentialprovider.kubelet.k8s.io/v1).

Reads a CredentialProviderRequest on stdin, appends it to $PLUGIN_RUNS (one JSON line
per run, so tests can count runs), and answers credentials for the request's registry:
username from ``--user``, password from $PLUGIN_PASSWORD, cacheKeyType from
$PLUGIN_CACHE_KEY_TYPE (default Registry), cacheDuration from $PLUGIN_CACHE_DURATION
(default: none, so the provider's defaultCacheDuration applies). $PLUGIN_MODE makes it
misbehave: exit, garbage, wrong-version, hang, flood (prints forever; its pid goes to
$PLUGIN_RUNS.pid).
"""

import json
import os
import sys
import time


def main() -> int:
    request = json.loads(sys.stdin.read())
    with open(os.environ["PLUGIN_RUNS"], "a") as f:
        f.write(json.dumps(request) + "\n")
    mode = os.environ.get("PLUGIN_MODE", "")
    if mode == "exit":
        print("secret " + os.environ.get("PLUGIN_PASSWORD", ""), file=sys.stderr)
        return 3
    if mode == "garbage":
        print("not json " + os.environ.get("PLUGIN_PASSWORD", ""))
        return 0
    if mode == "hang":
        time.sleep(30)
    if mode == "flood":
        with open(os.environ["PLUGIN_RUNS"] + ".pid", "w") as f:
            f.write(str(os.getpid()))
        chunk = (os.environ.get("PLUGIN_PASSWORD", "") + "x" * 65000 + "\n").encode()
        while True:
            sys.stdout.buffer.write(chunk)
    user = sys.argv[sys.argv.index("--user") + 1] if "--user" in sys.argv else "user"
    registry = request["image"].split("/", 1)[0]
    answer = {"apiVersion": "credentialprovider.kubelet.k8s.io/v1" if mode != "wrong-version" else "v0",
              "kind": "CredentialProviderResponse",
              "cacheKeyType": os.environ.get("PLUGIN_CACHE_KEY_TYPE", "Registry"),
              "auth": {registry: {"username": user, "password": os.environ["PLUGIN_PASSWORD"]}}}
    if "PLUGIN_CACHE_DURATION" in os.environ:
        answer["cacheDuration"] = os.environ["PLUGIN_CACHE_DURATION"]
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
