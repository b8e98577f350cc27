// The official TypeScript SDKs against ringserve, for tests/system/test_ts_sdks.py.
//
// node tests/ts/sdk_streams.mjs URL streams | URL loop SURFACE | URL silences | URL thinking  ->  one JSON object on stdout
//
// streams: on every surface (Anthropic messages.stream, OpenAI chat.completions.stream, OpenAI
// responses.stream) and for every prompt of PROMPTS, the stream read through the SDK's own helper
// (its deltas, and its accumulator: finalMessage / finalChatCompletion / finalResponse) and the
// same request without streaming, each summed up as {text, calls, stop} (or {error}).
// loop: on SURFACE (anthropic, chat, responses), a chat loop's second turn, which sends back what the
// first turn's stream helper returned (the OpenAI helpers add `parsed` and `parsed_arguments` to
// it), as {ok} or {error}.
// silences: the "mixed" prompt through responses.stream while the server pauses between tokens,
// so that keepalive response.in_progress events (each the response so far, which the helper takes
// as its snapshot) come in the middle of the text and of the call: the summary, and how many came.
// thinking: a thinking model's reply on every surface through the helpers: what the accumulator,
// the reasoning deltas and the plain answer say of its reasoning and text; then a second turn that
// sends back what the helper returned (Anthropic's thinking block with its signature, Chat's
// message with its reasoning_content, Responses' output with its reasoning item), as the fields
// the server named in its Ringserve-Ignored-Fields header.
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";

const [url, mode, surface] = process.argv.slice(2);
const anthropic = new Anthropic({ baseURL: url, apiKey: "unused", maxRetries: 0 });
const openai = new OpenAI({ baseURL: `${url}/v1`, apiKey: "unused", maxRetries: 0 });

const MODEL = "any-name";
const MAX = 256;
const TOOL = {
  name: "get_weather",
  description: "The weather in a city.",
  schema: {
    type: "object",
    properties: { city: { type: "string" }, unit: { type: "string", enum: ["celsius", "fahrenheit"] } },
    required: ["city", "unit"],
    additionalProperties: false,
  },
};
// What the test's fake engine answers to each (test_ts_sdks.py): text, a forced call, text and a call.
const PROMPTS = { text: "echo:Grüße aus Köln, 世界! 👋🏽", forced: "Weather in Paris?", mixed: "Look it up." };
const WITH_TOOLS = { text: false, forced: true, mixed: true };

function anthropicParams(kind) {
  const params = { model: MODEL, max_tokens: MAX, messages: [{ role: "user", content: PROMPTS[kind] }] };
  if (!WITH_TOOLS[kind]) return params;
  return {
    ...params,
    tools: [{ name: TOOL.name, description: TOOL.description, input_schema: TOOL.schema }],
    tool_choice: kind === "forced" ? { type: "tool", name: TOOL.name } : { type: "auto" },
  };
}

function chatParams(kind) {
  const params = { model: MODEL, max_tokens: MAX, messages: [{ role: "user", content: PROMPTS[kind] }] };
  if (!WITH_TOOLS[kind]) return params;
  return {
    ...params,
    tools: [{ type: "function", function: { name: TOOL.name, description: TOOL.description, parameters: TOOL.schema } }],
    tool_choice: kind === "forced" ? { type: "function", function: { name: TOOL.name } } : "auto",
  };
}

function responsesParams(kind) {
  const params = { model: MODEL, max_output_tokens: MAX, input: PROMPTS[kind] };
  if (!WITH_TOOLS[kind]) return params;
  return {
    ...params,
    tools: [{ type: "function", name: TOOL.name, description: TOOL.description, parameters: TOOL.schema, strict: false }],
    tool_choice: kind === "forced" ? { type: "function", name: TOOL.name } : "auto",
  };
}

const summary = {
  anthropic: (m) => ({
    text: m.content.filter((b) => b.type === "text").map((b) => b.text).join(""),
    calls: m.content.filter((b) => b.type === "tool_use").map((b) => ({ name: b.name, arguments: b.input })),
    stop: m.stop_reason,
  }),
  chat: (c) => ({
    text: c.choices[0].message.content ?? "",
    calls: (c.choices[0].message.tool_calls ?? []).map((t) => ({
      name: t.function.name, arguments: JSON.parse(t.function.arguments), raw: t.function.arguments,
    })),
    stop: c.choices[0].finish_reason,
  }),
  responses: (r) => ({
    text: r.output_text,
    calls: r.output.filter((i) => i.type === "function_call").map((i) => ({
      name: i.name, arguments: JSON.parse(i.arguments), raw: i.arguments,
    })),
    stop: r.status,
  }),
};

// Each surface's stream through its helper: [final object, {text, arguments} joined from the deltas].
const streamed = {
  anthropic: async (kind) => {
    const deltas = { text: "", arguments: "" };
    const stream = anthropic.messages.stream(anthropicParams(kind));
    stream.on("text", (delta) => { deltas.text += delta; });
    stream.on("streamEvent", (event) => {
      if (event.type === "content_block_delta" && event.delta.type === "input_json_delta") {
        deltas.arguments += event.delta.partial_json;
      }
    });
    return [await stream.finalMessage(), deltas];
  },
  chat: async (kind) => {
    const deltas = { text: "", arguments: "" };
    const stream = openai.chat.completions.stream(chatParams(kind));
    stream.on("content.delta", ({ delta }) => { deltas.text += delta; });
    stream.on("tool_calls.function.arguments.delta", ({ arguments_delta }) => { deltas.arguments += arguments_delta; });
    return [await stream.finalChatCompletion(), deltas];
  },
  responses: async (kind) => {
    const deltas = { text: "", arguments: "" };
    const stream = openai.responses.stream(responsesParams(kind));
    stream.on("response.output_text.delta", ({ delta }) => { deltas.text += delta; });
    stream.on("response.function_call_arguments.delta", ({ delta }) => { deltas.arguments += delta; });
    return [await stream.finalResponse(), deltas];
  },
};

const plain = {
  anthropic: (kind) => anthropic.messages.create(anthropicParams(kind)),
  chat: (kind) => openai.chat.completions.create(chatParams(kind)),
  responses: (kind) => openai.responses.create(responsesParams(kind)),
};

async function outcome(run) {
  try {
    return await run();
  } catch (error) {
    return { error: `${error.constructor.name}: ${error.message}` };
  }
}

async function streams() {
  const results = {};
  for (const surface of Object.keys(streamed)) {
    for (const kind of Object.keys(PROMPTS)) {
      results[`${surface}/${kind}`] = {
        stream: await outcome(async () => {
          const [final, deltas] = await streamed[surface](kind);
          return { ...summary[surface](final), deltas };
        }),
        plain: await outcome(async () => summary[surface](await plain[surface](kind))),
      };
    }
  }
  return results;
}

const RESULT = "18 degrees, sunny";

// Each surface's second turn, made of what its stream helper returned for a forced call.
const loops = {
  anthropic: async () => {
    const params = anthropicParams("forced");
    const final = await anthropic.messages.stream(params).finalMessage();
    const call = final.content.find((b) => b.type === "tool_use");
    const result = { role: "user", content: [{ type: "tool_result", tool_use_id: call.id, content: RESULT }] };
    await anthropic.messages.create({ ...params, tool_choice: { type: "auto" },
      messages: [...params.messages, { role: final.role, content: final.content }, result] });
  },
  chat: async () => {
    const params = chatParams("forced");
    const final = await openai.chat.completions.stream(params).finalChatCompletion();
    const message = final.choices[0].message;
    const result = { role: "tool", tool_call_id: message.tool_calls[0].id, content: RESULT };
    await openai.chat.completions.create({ ...params, tool_choice: "auto", messages: [...params.messages, message, result] });
  },
  responses: async () => {
    const params = responsesParams("forced");
    const final = await openai.responses.stream(params).finalResponse();
    const call = final.output.find((i) => i.type === "function_call");
    const result = { type: "function_call_output", call_id: call.call_id, output: RESULT };
    await openai.responses.create({ ...params, tool_choice: "auto",
      input: [{ role: "user", content: params.input }, ...final.output, result] });
  },
};

async function silences() {
  return outcome(async () => {
    let keepalives = 0;
    const deltas = { text: "", arguments: "" };
    const stream = openai.responses.stream(responsesParams("mixed"));
    stream.on("response.in_progress", () => { keepalives += 1; });
    stream.on("response.output_text.delta", ({ delta }) => { deltas.text += delta; });
    stream.on("response.function_call_arguments.delta", ({ delta }) => { deltas.arguments += delta; });
    return { ...summary.responses(await stream.finalResponse()), deltas, keepalives };
  });
}

const reasoningOf = {
  anthropic: (m) => ({
    reasoning: m.content.filter((b) => b.type === "thinking").map((b) => b.thinking).join(""),
    signatures: m.content.filter((b) => b.type === "thinking").map((b) => b.signature),
    text: m.content.filter((b) => b.type === "text").map((b) => b.text).join(""),
  }),
  chat: (c) => ({ reasoning: c.choices[0].message.reasoning_content ?? "", text: c.choices[0].message.content ?? "" }),
  responses: (r) => ({
    reasoning: r.output.filter((i) => i.type === "reasoning").flatMap((i) => i.content ?? []).map((p) => p.text).join(""),
    text: r.output_text,
  }),
};

// The thinking requests: a prompt that is no echo (the fake engine then plays its thinking reply).
const THINK = "Think first.";
const thinkParams = {
  anthropic: () => ({ ...anthropicParams("text"), messages: [{ role: "user", content: THINK }] }),
  chat: () => ({ ...chatParams("text"), messages: [{ role: "user", content: THINK }] }),
  responses: () => ({ ...responsesParams("text"), input: THINK }),
};

// Each surface's thinking stream through its helper: [final object, the reasoning its deltas add up to].
const thoughts = {
  anthropic: async () => {
    const deltas = { reasoning: "", signature: "" };
    const stream = anthropic.messages.stream(thinkParams.anthropic());
    stream.on("thinking", (delta) => { deltas.reasoning += delta; });
    stream.on("signature", (signature) => { deltas.signature = signature; });
    return [await stream.finalMessage(), deltas];
  },
  chat: async () => {
    const deltas = { reasoning: "" };
    const stream = openai.chat.completions.stream(thinkParams.chat());
    stream.on("chunk", (chunk) => { deltas.reasoning += chunk.choices[0]?.delta?.reasoning_content ?? ""; });
    return [await stream.finalChatCompletion(), deltas];
  },
  responses: async () => {
    const deltas = { reasoning: "" };
    const stream = openai.responses.stream(thinkParams.responses());
    stream.on("response.reasoning_text.delta", ({ delta }) => { deltas.reasoning += delta; });
    return [await stream.finalResponse(), deltas];
  },
};

const thinkPlain = {
  anthropic: () => anthropic.messages.create(thinkParams.anthropic()),
  chat: () => openai.chat.completions.create(thinkParams.chat()),
  responses: () => openai.responses.create(thinkParams.responses()),
};

// The second turn of a thinking loop: the helper's message sent back as the assistant's turn; the
// fields the server reports ignored (a thinking block or reasoning item it dropped would be there).
const ignoredBy = async (request) => {
  const { response } = await request.withResponse();
  return (response.headers.get("ringserve-ignored-fields") ?? "").split(", ").filter((f) => f);
};
const thinkingLoops = {
  anthropic: async (final) => {
    const params = thinkParams.anthropic();
    return ignoredBy(anthropic.messages.create({ ...params, messages: [...params.messages,
      { role: "assistant", content: final.content }, { role: "user", content: "And then?" }] }));
  },
  chat: async (final) => {
    const params = thinkParams.chat();
    return ignoredBy(openai.chat.completions.create({ ...params, messages: [...params.messages,
      final.choices[0].message, { role: "user", content: "And then?" }] }));
  },
  responses: async (final) => {
    const params = thinkParams.responses();
    return ignoredBy(openai.responses.create({ ...params, input: [{ role: "user", content: params.input },
      ...final.output, { role: "user", content: "And then?" }] }));
  },
};

async function thinking() {
  const results = {};
  for (const name of Object.keys(thoughts)) {
    let final = null;
    results[name] = {
      stream: await outcome(async () => {
        const [object, deltas] = await thoughts[name]();
        final = object;
        return { ...reasoningOf[name](object), deltas };
      }),
      plain: await outcome(async () => reasoningOf[name](await thinkPlain[name]())),
    };
    if (final !== null) {
      results[name].loop = await outcome(async () => ({ ignored: await thinkingLoops[name](final) }));
    }
  }
  return results;
}

const modes = {
  streams, silences, thinking, loop: () => outcome(async () => { await loops[surface](); return { ok: true }; }),
};
process.stdout.write(JSON.stringify(await modes[mode]()) + "\n");
