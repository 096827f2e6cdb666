"""Session 27: a seeded request to a loaded `specdec serve` gives one text, with speculation on or off, and the
CLI's `generate` gives it too. Start the server first:  specdec serve --model smollm2-135m --port 8765
then:  .venv/bin/python benchmarks/s27/seeded_server.py  (output: benchmarks/s27/seeded-server.txt)."""
import concurrent.futures as cf
import json
import subprocess

import openai

c = openai.OpenAI(base_url="http://127.0.0.1:8765/v1", api_key="x", max_retries=0)
msg = [{"role": "user", "content": "List five fruits and one fact about each."}]


def ask(spec, seed=7):
    r = c.chat.completions.create(model="smollm2-135m", messages=msg, max_tokens=48, temperature=0.8, top_p=0.95,
                                  seed=seed, extra_body={"speculation": spec})
    return r.choices[0].message.content


alone = ask(False)
with cf.ThreadPoolExecutor(12) as ex:  # 8 seeded requests beside 4 others of other seeds
    fs = [ex.submit(ask, s) for s in [{"method": "recycling"}, {"method": "prompt-lookup", "k": 4}, "auto", False] * 2]
    noise = [ex.submit(ask, "auto", seed=i) for i in range(4)]
    texts = [f.result() for f in fs]
print("distinct texts of the seeded request (alone without speculation, then 8 under load):",
      len(set(texts + [alone])), "of", len(texts) + 1)
cli = subprocess.run(["specdec", "generate", "List five fruits and one fact about each.", "--model", "smollm2-135m",
                      "--max-new-tokens", "48", "--temperature", "0.8", "--top-p", "0.95", "--seed", "7",
                      "--method", "recycling", "--json"], capture_output=True, text=True)
print("specdec generate --method recycling --seed 7 gives the server's text:", json.loads(cli.stdout)["text"] == alone)
print(repr(alone))
